"""Every error path of a live server, answered in OpenAI's JSON error shape with the right status and a message that
names the parameter, its value and what is allowed; after each one the server still answers /health and requests."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
from server_harness import MODEL_NAME, live_server, make_engine, metric, scrape

from dspark.engine.llm_engine import LLMEngine

KEY = "s3cret-key"
MAX_BODY = 4096
MAX_MODEL_LEN = 128
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[tuple[str, LLMEngine]]:
    engine = make_engine(tiny_llama, max_model_len=MAX_MODEL_LEN)
    with live_server(engine, api_key=KEY, max_body_bytes=MAX_BODY) as url:
        yield url, engine


@pytest.fixture(autouse=True)
def still_serving(server: tuple[str, LLMEngine]) -> Iterator[None]:
    """After every test here: /health answers 200 without a key, and a request still completes."""
    yield
    assert _request(server[0], "GET", "/health", headers={})[0] == 200
    status, body = _post(server[0], "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def _request(
    url: str, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request(
            method, path, body=body, headers={"Authorization": f"Bearer {KEY}"} if headers is None else headers
        )
        response = conn.getresponse()
        data = response.read()
        kind = response.getheader("content-type") or ""
        return response.status, json.loads(data) if kind.startswith("application/json") else data.decode()
    finally:
        conn.close()


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    return _request(url, "POST", path, json.dumps(body).encode(), {"Authorization": f"Bearer {KEY}"})


def _error(status_body: tuple[int, Any], status: int) -> dict[str, Any]:
    got, body = status_body
    assert got == status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_api_key(server: tuple[str, LLMEngine]) -> None:
    url = server[0]
    missing = _error(_request(url, "GET", "/v1/models", headers={}), 401)
    assert missing["type"] == "authentication_error" and "Authorization: Bearer" in missing["message"]
    wrong = _error(_request(url, "GET", "/v1/models", headers={"Authorization": "Bearer nope"}), 401)
    assert wrong["code"] == "invalid_api_key" and KEY not in wrong["message"]
    _error(_request(url, "GET", "/v1/models", headers={"Authorization": f"Basic {KEY}"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).completions.create(
            model=MODEL_NAME, prompt="x"
        )
    assert _request(url, "GET", "/v1/models")[0] == 200
    assert _request(url, "GET", "/metrics", headers={})[0] == 200  # scrapers need no key, as in vLLM


def test_unknown_model_path_and_method(server: tuple[str, LLMEngine]) -> None:
    url = server[0]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert "gpt-4o" in str(e.value) and MODEL_NAME in str(e.value)
    err = _error(_post(url, "/v1/completions", {"model": "nope", "prompt": "x"}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    assert "/v1/nothing" in _error(_request(url, "GET", "/v1/nothing"), 404)["message"]
    _error(_request(url, "GET", "/v1/completions"), 405)


M = {"messages": CHAT}


@pytest.mark.parametrize(
    ("path", "body", "param", "needle"),
    [
        ("completions", {"prompt": "x", "temperature": -1}, "temperature", "[0.0, 1000000.0]"),
        ("completions", {"prompt": "x", "temperature": float("nan")}, "temperature", "finite"),
        ("completions", {"prompt": "x", "top_p": 0}, "top_p", "(0.0, 1.0]"),
        ("completions", {"prompt": "x", "top_k": -2}, "top_k", "[-1, inf]"),
        ("completions", {"prompt": "x", "min_p": 2}, "min_p", "[0.0, 1.0]"),
        ("completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty", "[-2.0, 2.0]"),
        ("completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty", "[-2.0, 2.0]"),
        ("completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "(0.0,"),
        ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "[1, inf]"),
        ("completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens", "valid integer"),
        ("completions", {"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
        ("completions", {"prompt": "x", "n": 129}, "n", "less than or equal to 128"),
        ("completions", {"prompt": "x", "logprobs": 21}, "logprobs", "[0, 20]"),
        ("completions", {"prompt": "x", "stop": [1]}, "stop", "a string or a list of strings"),
        ("completions", {"prompt": "x", "stop": [""]}, "stop", "non-empty"),
        ("completions", {"prompt": "x", "seed": 2**64}, "seed", "[-9223372036854775808"),
        ("completions", {"prompt": "x", "seed": 2**63 - 1, "n": 2}, "seed", "64-bit"),
        ("completions", {"prompt": "x", "stream": "yes"}, "stream", "valid boolean"),
        ("completions", {"prompt": "x", "stop_token_ids": [49152]}, "stop_token_ids", "[0, 49152)"),
        ("completions", {"prompt": [1, 49152]}, "prompt", "[0, 49152)"),
        ("completions", {"prompt": []}, "prompt", "a list of token ids"),
        ("completions", {"prompt": ""}, "prompt", "must not be empty"),
        ("completions", {"prompt": "\ud800"}, "prompt", "lone surrogates"),
        ("completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"),
        ("completions", {"prompt": "x", "echo": True, "logprobs": 21}, "logprobs", "[0, 20]"),
        ("completions", {"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        ("completions", {"prompt": "x", "best_of": 3}, "best_of", "must equal n"),
        ("completions", {"prompt": "x", "logit_bias": {"5": 1}}, "logit_bias", "not supported"),
        ("completions", {"max_tokens": 3}, "prompt", "is required"),
        ("chat/completions", {"messages": []}, "messages", "at least 1 item"),
        ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "a string"),
        ("chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role", "is required"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content",
            "only text content parts",
        ),
        ("chat/completions", {**M, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ("chat/completions", {**M, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        ("chat/completions", {**M, "logprobs": 1}, "logprobs", "valid boolean"),
        ("chat/completions", {**M, "max_completion_tokens": 0}, "max_completion_tokens", "[1, inf]"),
        ("chat/completions", {**M, "tools": [{"type": "function"}]}, "tools", "not supported"),
        ("chat/completions", {**M, "response_format": {"type": "json_object"}}, "response_format", "text"),
    ],
)
def test_invalid_parameters(
    server: tuple[str, LLMEngine], path: str, body: dict[str, Any], param: str, needle: str
) -> None:
    err = _error(_post(server[0], f"/v1/{path}", {"model": MODEL_NAME, **body}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"].startswith(param) and needle in err["message"], err["message"]


def test_prompt_longer_than_the_context(server: tuple[str, LLMEngine]) -> None:
    url = server[0]
    err = _error(_post(url, "/v1/completions", {"prompt": [5] * MAX_MODEL_LEN}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert f"{MAX_MODEL_LEN} tokens" in err["message"] and f"at most {MAX_MODEL_LEN - 1}" in err["message"]
    assert _post(url, "/v1/completions", {"prompt": [5] * (MAX_MODEL_LEN - 1), "max_tokens": 1})[0] == 200
    long_chat = [{"role": "user", "content": "word " * MAX_MODEL_LEN}]
    err = _error(_post(url, "/v1/chat/completions", {"messages": long_chat}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"prompt": "x",', "not valid JSON"),
        (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
        (b'["prompt"]', "must be a JSON object, not list"),
        (b"", "not valid JSON"),
        (b"[" * 2000 + b"]" * 2000, "nested too deeply"),
    ],
)
def test_malformed_bodies(server: tuple[str, LLMEngine], body: bytes, needle: str) -> None:
    err = _error(_request(server[0], "POST", "/v1/completions", body), 400)
    assert needle in err["message"]


def test_oversized_body_with_and_without_content_length(server: tuple[str, LLMEngine]) -> None:
    url = server[0]
    big = json.dumps({"prompt": "x" * MAX_BODY}).encode()
    err = _error(_request(url, "POST", "/v1/completions", big), 413)
    assert err["code"] == "request_too_large" and str(MAX_BODY) in err["message"]
    # Chunked: no Content-Length to trust, so the limit is enforced while reading.
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        chunks = (big[i : i + 1000] for i in range(0, len(big), 1000))
        conn.request(
            "POST", "/v1/completions", body=chunks, headers={"Authorization": f"Bearer {KEY}"}, encode_chunked=True
        )
        response = conn.getresponse()
        assert response.status == 413 and "too large" in json.loads(response.read())["error"]["message"]
    finally:
        conn.close()


def test_unknown_fields_are_ignored(server: tuple[str, LLMEngine]) -> None:
    status, body = _post(server[0], "/v1/completions", {"prompt": "x", "max_tokens": 2, "not_a_field": [1, 2]})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(
    server: tuple[str, LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, engine = server
    real_step = engine.step
    calls = {"n": 0}

    def step_that_fails_twice() -> Any:
        calls["n"] += 1
        if calls["n"] in (3, 5):  # mid-request: the first two steps of a request have run
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", step_that_fails_twice)
    err = _error(_post(url, "/v1/completions", {"prompt": "x", "max_tokens": 10, "ignore_eos": True}), 500)
    assert "RuntimeError: boom" in err["message"] and err["type"] == "internal_server_error"
    # Streamed: the status (200) has gone out, so the failure arrives as an error event, then [DONE].
    status, text = _request(
        url,
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "x", "max_tokens": 10, "ignore_eos": True, "stream": True}).encode(),
    )
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]"
    assert "RuntimeError: boom" in json.loads(events[-2])["error"]["message"]
    metrics = scrape(url)
    assert metric(metrics, "dspark:engine_step_errors_total") == 2
    assert metric(metrics, "dspark:kv_cache_num_used_blocks") == 0 and metric(metrics, "dspark:engine_alive") == 1
