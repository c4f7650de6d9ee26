"""A request the engine fails alone (a fault while its output is processed: finish_reason "error") is a 500 in OpenAI's
error shape when not streamed, and an error event followed by [DONE] when streamed; a request running beside it
completes with exactly its fault-free output, no step is counted as failed, and every KV block comes back.

(A failed step, which fails every request in flight: tests/server/test_errors.py.)
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from server_harness import live_server, make_engine, metric, scrape, wait_for

from dspark.engine.llm_engine import LLMEngine

POISON = "poison"  # the prompt whose requests the engine fails


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[tuple[str, LLMEngine]]:
    engine = make_engine(tiny_llama, max_model_len=256)
    with live_server(engine) as url:
        yield url, engine


@pytest.fixture
def poisoned(server: tuple[str, LLMEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests for the POISON prompt get a detokenizer that raises on its third call (the engine thread adds them).
    A streamed request is detokenised token by token (add), a non-streamed one once, as it finishes (add_all)."""
    engine = server[1]
    poison = list(engine.tokenizer.encode(POISON, add_special_tokens=True))
    real_add = engine.add_request

    def add_request(prompt: Any, params: Any = None, request_id: str | None = None) -> str:
        rid = real_add(prompt, params, request_id)
        if list(prompt) == poison:
            detok = engine.output_processor.states[rid].detok
            calls = {"n": 0}

            def failing(real: Any) -> Any:
                def call(ids: list[int]) -> str:
                    calls["n"] += 1
                    if calls["n"] == 3 or real.__name__ == "add_all":
                        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
                    return real(ids)

                return call

            monkeypatch.setattr(detok, "add", failing(detok.add))
            monkeypatch.setattr(detok, "add_all", failing(detok.add_all))
        return rid

    monkeypatch.setattr(engine, "add_request", add_request)


def _open(url: str, body: dict[str, Any]) -> http.client.HTTPResponse:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return conn.getresponse()


def _events(response: http.client.HTTPResponse) -> Iterator[str]:
    """The data of each server-sent event, as it arrives."""
    while line := response.readline():
        if line.startswith(b"data: "):
            yield line.removeprefix(b"data: ").decode().strip()


def _body(prompt: str, stream: bool, max_tokens: int = 12) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


def test_a_request_failed_alone_is_an_error_and_the_others_go_on(server: tuple[str, LLMEngine], poisoned: None) -> None:
    url, engine = server
    healthy = "The quick brown fox"
    reference = json.loads(_open(url, _body(healthy, stream=False, max_tokens=60)).read())["choices"][0]["text"]
    before = scrape(url)

    stream = _open(url, _body(healthy, stream=True, max_tokens=60))
    events = _events(stream)
    text = "".join(json.loads(next(events))["choices"][0]["text"] for _ in range(2))  # it is running

    response = _open(url, _body(POISON, stream=False))
    error = json.loads(response.read())["error"]
    assert response.status == 500 and error["type"] == "internal_server_error"
    assert "failed in the engine" in error["message"] and "server log" in error["message"]

    streamed = list(_events(_open(url, _body(POISON, stream=True))))
    assert streamed[-1] == "[DONE]" and "failed in the engine" in json.loads(streamed[-2])["error"]["message"]
    assert all("error" not in json.loads(e) for e in streamed[:-2])  # its first tokens came through normally

    rest = list(events)
    assert rest[-1] == "[DONE]"
    text += "".join(json.loads(e)["choices"][0]["text"] for e in rest[:-1])
    assert text == reference  # the request beside the failed ones is untouched

    wait_for(lambda: engine.num_unfinished_requests == 0, what="the engine to go idle")
    after = scrape(url)
    failed = "dspark:num_requests_failed_total"
    assert metric(after, failed) - metric(before, failed) == 2
    assert metric(after, "dspark:engine_step_errors_total") == metric(before, "dspark:engine_step_errors_total")
    assert metric(after, "dspark:kv_cache_num_used_blocks") == 0 and metric(after, "dspark:engine_alive") == 1
