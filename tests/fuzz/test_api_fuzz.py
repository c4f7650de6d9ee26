"""Property-based fuzz of the HTTP API with bad input: hypothesis-made bodies for /v1/completions and
/v1/chat/completions, each field either a plausible value or any JSON at all (wrong types, NaN and infinities, ints of
hundreds of digits, empty and very long strings, lone surrogates, deep nesting, unknown fields), plus raw bodies that
are not JSON objects at all. Properties: never a 5xx; every 4xx is OpenAI's error shape; every 400 names its parameter
(`param`, which the message starts with) or says what is wrong with the body as a whole; every 200 is a well-formed
response with one choice per prompt and sample. Afterwards a normal request still completes and the engine holds no
requests and no KV blocks.

The app runs in-process (its ASGI callable, on one event loop in a background thread, since the AsyncEngine binds to
the loop it starts on), over a tiny random llama with n-gram speculation on, so each example costs milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dspark.config import EngineConfig
from dspark.engine.llm_engine import LLMEngine
from dspark.server.app import build_app
from dspark.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
)
from dspark.speculative.cost_model import CostModel

NAMES = ["tiny", "other-name"]
VOCAB = 49152
MAX_MODEL_LEN = 96  # small, so a request without max_tokens still ends within a few dozen steps
MAX_BODY = 8192
# Derandomized (the same examples on every run, as CI needs) and no example database (nothing written to the tree).
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

T = TypeVar("T")


class InProcessApp:
    """The app's lifespan and requests on one event loop in a background thread; requests are plain ASGI calls."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()
        self._lifespan = app.router.lifespan_context(app)
        self.call(self._lifespan.__aenter__())

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self._lifespan.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
        """(status, content type, body); an exception escaping the app counts as the 500 the server would send."""
        return self.call(self._post(path, body, headers))

    async def _post(self, path: str, body: bytes, headers: dict[str, str] | None) -> tuple[int, str, bytes]:
        headers = {"content-length": str(len(body)), **(headers or {})}
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
            "client": ("127.0.0.1", 12345),
            "server": ("127.0.0.1", 8000),
        }
        finished = asyncio.Event()
        body_sent = False
        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await finished.wait()  # the client stays until the response is complete
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    finished.set()

        try:
            await self.app(scope, receive, send)
        except Exception as e:  # Starlette re-raises after sending its 500; say what it was
            raise AssertionError(f"the app raised {type(e).__name__}: {e} for {body[:300]!r}") from e
        finally:
            finished.set()
        kind = dict(start.get("headers", [])).get(b"content-type", b"").decode()
        return start["status"], kind, b"".join(chunks)


@pytest.fixture(scope="module")
def served(tiny_model_dirs: dict[str, Path]) -> Iterator[tuple[InProcessApp, LLMEngine]]:
    config = EngineConfig(
        model=str(tiny_model_dirs["llama"]),
        dtype="float32",
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=128,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    # A fixed cost model: the engine needs no start-up profiling, and verification always looks worth it.
    cost = CostModel.from_points({1: 4.0, 16: 7.0, 64: 16.0}, {1: 0.5, 64: 0.5})
    engine = LLMEngine(config, cost)
    app = InProcessApp(build_app(engine, NAMES, max_body_bytes=MAX_BODY))
    yield app, engine
    app.close()


# ---- strategies ---------------------------------------------------------------------------------------------------

# Values that have broken JSON APIs before: bounds of int64 and float64, ints past Python's int-to-str limit once
# printed, NaN and infinities (Python's json reads and writes them), lone surrogates, NUL, strings past the body limit.
SPECIAL = st.sampled_from(
    [
        10**400,
        -(10**400),
        2**63,
        2**63 - 1,
        2**64,
        -(2**63) - 1,
        -1,
        0,
        1,
        1.5,
        -0.0,
        1e308,
        5e-324,
        math.nan,
        math.inf,
        -math.inf,
        "",
        "\ud800",
        "\x00",
        "1",
        "true",
        "x" * 3000,
        "é" * MAX_BODY,
        [],
        {},
        [[]],
        [None],
    ]
)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=16) | SPECIAL
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
DEEP = st.integers(1, 3000).map(lambda depth: json.loads("[" * min(depth, 500) + "]" * min(depth, 500)))

TEXT = st.text(min_size=1, max_size=24)
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
PROMPT = TEXT | st.lists(TEXT, min_size=1, max_size=3) | TOKEN_IDS | st.lists(TOKEN_IDS, min_size=1, max_size=2)
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=16)})
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant"]),
        "content": st.text(max_size=24) | st.lists(TEXT_PART, max_size=2) | st.none(),
    }
)

# Plausible values, field by field: a body built from these alone is valid (bar combinations SamplingParams refuses,
# such as min_tokens > max_tokens, which must then come back as a 400 naming the field).
SHARED: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([*NAMES, None]),
    "n": st.integers(1, 3),
    "temperature": st.sampled_from([0.0, 0.7, 1.0]) | st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 50) | st.just(VOCAB + 1),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 4),
    "stop": TEXT | st.lists(TEXT, max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2),
    "min_tokens": st.integers(0, 4),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "user": st.text(max_size=8),
    "logit_bias": st.just({}),
}
COMPLETION: dict[str, st.SearchStrategy[Any]] = {
    **SHARED,
    "prompt": PROMPT,
    "max_tokens": st.integers(1, 6),
    "logprobs": st.integers(0, 5),
    "echo": st.just(False),
    "suffix": st.sampled_from([None, ""]),
}
CHAT: dict[str, st.SearchStrategy[Any]] = {
    **SHARED,
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "max_tokens": st.integers(1, 6),
    "max_completion_tokens": st.integers(1, 6),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "tools": st.just([]),
    "tool_choice": st.sampled_from(["none", "auto"]),
    "response_format": st.just({"type": "text"}),
}
UNKNOWN_KEYS = ["not_a_field", "", "prompt ", "Messages", "functions", "\ud800", "x" * 100]


@st.composite
def bodies(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]], required: str) -> tuple[dict[str, Any], bool]:
    """(body, plausible): some fields with plausible values; then, unless plausible, a few (any field, or an unknown
    one) set to anything at all, or the field every request needs left out."""
    optional = {k: v for k, v in fields.items() if k != required}
    body = draw(st.fixed_dictionaries({required: fields[required]}, optional=optional))
    wild = draw(st.lists(st.sampled_from([*fields, *UNKNOWN_KEYS]), max_size=3, unique=True))
    for key in wild:
        body[key] = draw(ANY_JSON | DEEP)
    # 13, not 0, which hypothesis draws far more often than one time in twenty.
    missing = draw(st.integers(0, 19)) == 13
    if missing:
        body.pop(required, None)
    return body, not wild and not missing


# ---- properties ---------------------------------------------------------------------------------------------------


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # ASCII: lone surrogates travel as \ud800 escapes


def _error(status: int, kind: str, raw: bytes) -> dict[str, Any]:
    """The error object of a 4xx, checked against OpenAI's shape."""
    assert 400 <= status < 500, (status, raw[:500])
    assert kind.startswith("application/json"), kind
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    return err


def _check_rejection(status: int, kind: str, raw: bytes, sent: dict[str, Any], required: str) -> None:
    err = _error(status, kind, raw)
    if status == 404:
        assert err["param"] == "model" and sent.get("model") not in (*NAMES, None), err
    elif status == 413:
        assert err["code"] == "request_too_large" and len(_encode(sent)) > MAX_BODY, err
    else:
        assert status == 400, err
        param = err["param"]
        assert param, f"a 400 that names no parameter: {err}"
        assert err["message"].startswith(param), err
        keys = {k.encode("utf-8", "backslashreplace").decode() for k in sent}  # as the server names a bad key
        assert param.split(".")[0] in keys or param == required, (param, list(sent))


def _check_success(path: str, kind: str, raw: bytes, sent: dict[str, Any]) -> None:
    n = sent.get("n", 1)
    if path == "/v1/completions":
        prompt = sent["prompt"]
        num_prompts = 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)
    else:
        num_prompts = 1
    num_choices = n * num_prompts
    if not sent.get("stream"):
        assert kind.startswith("application/json"), kind
        model = CompletionResponse if path == "/v1/completions" else ChatCompletionResponse
        response = model.model_validate(json.loads(raw))
        assert [c.index for c in response.choices] == list(range(num_choices))
        assert all(c.finish_reason in ("stop", "length") for c in response.choices), response
        assert response.usage is not None and response.usage.completion_tokens >= 0
        return
    assert kind.startswith("text/event-stream"), kind
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]", events[-3:]
    finished: list[int] = []
    for line in events[:-1]:
        data = json.loads(line)
        assert "error" not in data, data
        chunk = (CompletionResponse if path == "/v1/completions" else ChatCompletionChunk).model_validate(data)
        finished += [c.index for c in chunk.choices if c.finish_reason is not None]
    assert sorted(finished) == list(range(num_choices)), finished


def _refusable(sent: dict[str, Any], err: dict[str, Any]) -> bool:
    """Whether a body of plausible values alone may be refused with this error: for a combination of them."""
    if sent.get("max_completion_tokens") is not None:
        max_tokens = sent["max_completion_tokens"]
    else:  # completions default to 16 tokens; chat to the rest of the context
        max_tokens = sent.get("max_tokens", 16 if "prompt" in sent else None)
    return (
        err["code"] == "context_length_exceeded"  # a few random characters can be many tokens
        or (err["param"] == "min_tokens" and max_tokens is not None and sent["min_tokens"] > max_tokens)
        or (err["param"] == "top_logprobs" and not sent.get("logprobs"))
    )


def _check(app: InProcessApp, path: str, generated: tuple[dict[str, Any], bool], required: str) -> None:
    sent, plausible = generated
    status, kind, raw = app.post(path, _encode(sent))
    event(f"{status} {json.loads(raw)['error']['param'] if status >= 400 else 'stream' if sent.get('stream') else ''}")
    if status == 200:
        _check_success(path, kind, raw, sent)
        return
    _check_rejection(status, kind, raw, sent, required)
    if plausible:
        err = json.loads(raw)["error"]
        assert _refusable(sent, err), f"a valid request refused: {sent} -> {err}"


def _assert_idle_and_serving(app: InProcessApp, engine: LLMEngine) -> None:
    """A normal request still completes; then no request is left in the engine and no KV block is held."""
    status, _, raw = app.post("/v1/completions", _encode({"prompt": "hello", "max_tokens": 2, "ignore_eos": True}))
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 2, raw
    deadline = time.monotonic() + 20  # aborts reach the engine thread through its queue, between steps
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    metrics = engine.get_metrics()
    assert not engine.has_unfinished_requests()
    assert metrics["num_requests_running"] == 0 and metrics["num_requests_waiting"] == 0, metrics
    assert metrics["kv_num_used_blocks"] == 0, metrics


def test_completions_fuzz(served: tuple[InProcessApp, LLMEngine]) -> None:
    app, engine = served

    @FUZZ
    @given(bodies(COMPLETION, "prompt"))
    def run(generated: tuple[dict[str, Any], bool]) -> None:
        _check(app, "/v1/completions", generated, "prompt")

    run()
    _assert_idle_and_serving(app, engine)


def test_chat_completions_fuzz(served: tuple[InProcessApp, LLMEngine]) -> None:
    app, engine = served

    @settings(FUZZ, max_examples=100)  # fewer: without max_tokens a chat runs to the end of the context
    @given(bodies(CHAT, "messages"))
    def run(generated: tuple[dict[str, Any], bool]) -> None:
        _check(app, "/v1/chat/completions", generated, "messages")

    run()
    _assert_idle_and_serving(app, engine)


def _deep(depth: int) -> bytes:
    return b'{"prompt": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"


RAW_BODIES = st.one_of(
    st.binary(max_size=64),  # mostly not UTF-8, or not JSON
    st.binary(max_size=16).map(lambda b: b'{"prompt": "' + b + b'"}'),  # invalid UTF-8 inside a string
    ANY_JSON.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),  # not an object
    st.integers(1, 4000).map(lambda d: b"[" * d + b"]" * d),
    st.integers(1, 4000).map(_deep),
    st.integers(4290, 4400).map(lambda d: b'{"prompt": "x", "n": ' + b"7" * d + b"}"),  # int-to-str limit: 4300
    st.integers(1, 3).map(lambda k: b'{"prompt": "' + b"x" * (MAX_BODY * k) + b'"}'),
    st.sampled_from([b"", b"null", b"{", b'{"prompt": NaN}', b'{"prompt": "x"}{}', b"\xef\xbb\xbf{}"]),
)
CONTENT_LENGTHS = st.sampled_from([None, "", "abc", "-1", " 5", "1e3", "\u00b2", "99999999999999999999"])


def test_raw_bodies_fuzz(served: tuple[InProcessApp, LLMEngine]) -> None:
    """Bodies that are not JSON objects, or not UTF-8, or too deep, too large, or with a Content-Length that lies:
    each a 4xx in OpenAI's shape; a 400 that names no field says what is wrong with the body."""
    app, engine = served

    @settings(FUZZ, max_examples=400)  # more: most are refused before they reach the engine
    @given(RAW_BODIES, CONTENT_LENGTHS, st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def run(raw: bytes, length: str | None, path: str) -> None:
        status, kind, answer = app.post(path, raw, None if length is None else {"content-length": length})
        if status == 200:  # only a valid request can get here
            body = json.loads(raw)
            _check_success(path, kind, answer, body)
            return
        err = _error(status, kind, answer)
        if err["param"] is None:
            assert err["code"] in ("invalid_json", "invalid_body", "request_too_large", "invalid_content_length"), err
        else:
            assert err["message"].startswith(err["param"]), err

    run()
    _assert_idle_and_serving(app, engine)
