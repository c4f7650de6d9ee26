"""`dspark serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine thread."""
