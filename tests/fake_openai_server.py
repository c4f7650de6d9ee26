"""A small OpenAI-compatible server for the client tests: streamed answers with set delays, spec-decode counters that
move with every answer, failures on demand, and a record of what it was sent and how many requests it held at once.

It runs uvicorn in a background thread of the test process, so its clock (time.perf_counter) is the client's.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

MODEL = "fake-model"
# Per answered request the counters move by: 2 drafts of 3 tokens, 3 accepted (2 at position 0, 1 at 1, 0 at 2).
DRAFTS, DRAFT_TOKENS, ACCEPTED, ACCEPTED_PER_POS = 2, 6, 3, (2, 1, 0)
# Where the counters start, so that only a before/after delta gives the per-run numbers.
BASE_DRAFTS, BASE_DRAFT_TOKENS, BASE_ACCEPTED, BASE_PER_POS = 100, 300, 120, (70, 40, 10)

Answer = Callable[[dict[str, Any]], tuple[str, str]]  # request body -> (text, finish_reason)


@dataclass
class Behaviour:
    ttft_s: float = 0.0  # before the first text chunk (a chat stream's role chunk goes out at once)
    itl_s: float = 0.0  # between text chunks
    num_chunks: int = 8  # text chunks of the default answer
    tokens_per_chunk: int = 1  # completion tokens each chunk stands for (speculation emits several per step)
    fail_every: int = 0  # every n-th request gets HTTP 500
    cut_every: int = 0  # every n-th request's stream ends after two chunks, without [DONE]
    spec: bool = True  # expose the spec-decode counters
    answer: Answer | None = None  # else " tok0 tok1 ..." of num_chunks chunks, finish_reason "length"


def prompt_words(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(m["content"].split()) for m in body["messages"])
    return len(body["prompt"].split())


@dataclass
class FakeServer:
    behaviour: Behaviour = field(default_factory=Behaviour)
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # perf_counter at each request's arrival
    auth: set[tuple[str, str | None]] = field(default_factory=set)  # (path, Authorization header) seen
    in_flight: int = 0
    peak_in_flight: int = 0
    answered: int = 0

    def reset(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.bodies, self.arrivals, self.auth = [], [], set()
        self.in_flight = self.peak_in_flight = 0

    def metrics_text(self) -> str:
        n = self.answered
        lines = [
            "# HELP dspark:num_requests_running Requests running.",
            "# TYPE dspark:num_requests_running gauge",
            f'dspark:num_requests_running{{model_name="{MODEL}"}} {self.in_flight}',
        ]
        if self.behaviour.spec:
            lines += [
                "# TYPE dspark:spec_decode_num_drafts counter",
                f'dspark:spec_decode_num_drafts_total{{model_name="{MODEL}"}} {BASE_DRAFTS + DRAFTS * n}.0',
                f'dspark:spec_decode_num_drafts_created{{model_name="{MODEL}"}} 1.7e+09',
                f"dspark:spec_decode_num_draft_tokens_total {BASE_DRAFT_TOKENS + DRAFT_TOKENS * n}",
                f"dspark:spec_decode_num_accepted_tokens_total {BASE_ACCEPTED + ACCEPTED * n}",
            ]
            for pos, (base, step) in enumerate(zip(BASE_PER_POS, ACCEPTED_PER_POS, strict=True)):
                lines.append(
                    f'dspark:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{MODEL}",position="{pos}"}} '
                    f"{base + step * n}"
                )
        return "\n".join(lines) + "\n"

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def record_auth(request: Request, call_next: Any) -> Any:
            self.auth.add((request.url.path, request.headers.get("authorization")))
            return await call_next(request)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(self.metrics_text())

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await self.handle(await request.json(), chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await self.handle(await request.json(), chat=True)

        return app

    async def handle(self, body: dict[str, Any], chat: bool) -> Any:
        b = self.behaviour
        self.arrivals.append(time.perf_counter())
        self.bodies.append(body)
        index = len(self.bodies)
        if b.fail_every and index % b.fail_every == 0:
            error = {"message": "injected failure", "type": "internal_server_error", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=500)
        if b.answer is not None:
            text, finish = b.answer(body)
            pieces = [w + " " for w in text.split(" ")] if text else []
        else:
            pieces, finish = [f" tok{i}" for i in range(b.num_chunks)], "length"
        cut = bool(b.cut_every and index % b.cut_every == 0)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return StreamingResponse(self.stream(body, chat, pieces, finish, cut), media_type="text/event-stream")

    async def stream(self, body: dict[str, Any], chat: bool, pieces: list[str], finish: str, cut: bool) -> Any:
        b = self.behaviour

        def event(choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> str:
            chunk = {"id": "cmpl-1", "object": "chunk", "model": MODEL, "choices": [choice] if choice else []}
            if usage is not None:
                chunk["usage"] = usage
            return f"data: {json.dumps(chunk)}\n\n"

        def piece(text: str, finish_reason: str | None = None) -> dict[str, Any]:
            if chat:
                return {"index": 0, "delta": {"content": text}, "finish_reason": finish_reason}
            return {"index": 0, "text": text, "finish_reason": finish_reason}

        try:
            if chat:
                yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            await asyncio.sleep(b.ttft_s)
            for i, text in enumerate(pieces):
                if i:
                    await asyncio.sleep(b.itl_s)
                if cut and i == 2:
                    return
                yield event(piece(text))
            self.answered += 1
            yield event(piece("", finish))
            if (body.get("stream_options") or {}).get("include_usage"):
                completion = len(pieces) * b.tokens_per_chunk
                prompt = prompt_words(body)
                usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
                yield event(None, usage)
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


@contextmanager
def serve(behaviour: Behaviour | None = None) -> Iterator[FakeServer]:
    fake = FakeServer(behaviour or Behaviour())
    with serve_app(fake.app()) as url:
        fake.url = url
        yield fake


@contextmanager
def serve_app(app: FastAPI) -> Iterator[str]:
    """Any ASGI app on 127.0.0.1:<free port>, in a background thread; yields its root URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
