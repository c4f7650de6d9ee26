"""Accuracy and sanity evaluations run through a server's OpenAI-compatible API (`dspark eval ...`)."""
