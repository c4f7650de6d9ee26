"""A request ended by a stop string counts the tokens up to the one that completed it, and none after (vLLM's rule):
in usage.completion_tokens, in the per-request generation-tokens histogram and in the generation_tokens counter, with
the engine in the server's process and in its own, where the core goes on running the request until the front's stop
reaches it. Speculative steps append several tokens; the stop string is completed by the first of them.

The core in its own process: the tokens it made between the front's stop and the stop's arrival are taken back when
they reach the front (those of an output that ended the request too); the core says when it has stopped the request,
so the front forgets it, as the core forgets which API server it came from."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from server_harness import MODEL_NAME, drained, live_server, make_engine, metric, scrape, wait_for

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.core import EngineCore
from dspark.engine.core_proc import AddRequests, CoreLoop, StepOutputs, StopRequests, output_decoder
from dspark.engine.input_processor import InputProcessor
from dspark.outputs import RequestOutput
from dspark.server.process_engine import ProcessEngine

PROMPT = "The quick brown fox"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "enable_adaptive_verification": False}
ENGINE: dict[str, Any] = {"max_model_len": 1024, "num_kv_blocks": 256}


def stop_inside_a_step(tokenizer: Any, tokens: list[int], sizes: list[int]) -> tuple[str, int]:
    """A stop string that the first token of a step of several tokens completes (its first occurrence: the text up to
    that token), and how many tokens the output keeps. (As tests/engine/test_stop_string_token_counts.py's.)"""
    start = 0
    for size in sizes:
        if size > 1 and start >= 2:
            text = tokenizer.decode(tokens[: start + 1])
            if text.strip() and text != tokenizer.decode(tokens[:start]) and "\ufffd" not in text:
                return text, start + 1
        start += size
    raise AssertionError(f"no step of several tokens to stop inside: {sizes}")


@pytest.fixture(scope="module")
def case(tiny_llama: Path) -> tuple[str, int]:
    """(stop string, tokens kept): a stop string that the first token of a speculative step of several completes."""
    engine = make_engine(tiny_llama, NGRAM, **ENGINE)
    engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, output_kind="delta"))
    tokens: list[int] = []
    sizes: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            sizes.append(len(out.new_token_ids))
    return stop_inside_a_step(engine.tokenizer, tokens, sizes)


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request: pytest.FixtureRequest, tiny_llama: Path) -> Iterator[str]:
    if request.param == "thread":
        engine: Any = make_engine(tiny_llama, NGRAM, **ENGINE)
    else:
        config = EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu", speculative_config=NGRAM, **ENGINE)
        engine = ProcessEngine(config)
    with live_server(engine) as url:
        wait_for(lambda: metric(scrape(url), "dspark:engine_alive") == 1, 120, "the engine to be ready")
        yield url


def _post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(usage, finish_reason) of a completion, whole or streamed (with include_usage)."""
    data = json.dumps({"model": MODEL_NAME, **body}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        if not body.get("stream"):
            answer = json.loads(r.read())
            return answer["usage"], answer["choices"][0]["finish_reason"]
        chunks = [json.loads(line[6:]) for line in r if line.startswith(b"data: {")]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert chunks[-1]["choices"] == [] and len(finish) == 1
    return chunks[-1]["usage"], finish[0]


@pytest.mark.parametrize("stream", [False, True])
def test_no_token_past_a_stop_string_is_counted(server: str, case: tuple[str, int], stream: bool) -> None:
    url = server
    stop, num_kept = case
    before = scrape(url)
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    usage, finish = _post(url, body)
    assert finish == "stop"
    assert usage["completion_tokens"] == num_kept, "usage counts tokens past the stop string"
    wait_for(lambda: drained(url), what="the request to leave the core")
    # The counter never goes down: tokens past the stop that a scrape saw before they were taken back (the core in its
    # own process) hold it until new tokens make up for them. A plain request's do: as many as the other could make.
    plain = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    assert _post(url, plain)[0]["completion_tokens"] == 60
    wait_for(lambda: drained(url), what="the plain request to leave the core")

    def counted(name: str) -> float:
        return metric(scrape(url), name) - metric(before, name)

    # The core's counters reach the front with its messages: a moment for the last ones.
    deadline = time.monotonic() + 2.0
    while counted("dspark:generation_tokens_total") != num_kept + 60 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # and no later change
    assert counted("dspark:generation_tokens_total") == num_kept + 60, "the counter counts tokens past the stop string"
    assert counted("dspark:request_generation_tokens_sum") == num_kept + 60
    assert counted("dspark:request_generation_tokens_count") == 2


# ---- the race, step by step: a front and a core, with the messages between them in the test's hands -----------------


class _Client:
    """The front's end of the sockets: what it sends the core."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)

    def take(self) -> list[Any]:
        sent, self.sent = self.sent, []
        return sent


class _Socket:
    """One of the core's output sockets."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, data: bytes) -> None:
        self.sent.append(output_decoder.decode(data))

    def take(self) -> list[Any]:
        sent, self.sent = self.sent, []
        return sent


@pytest.fixture(scope="module")
def core(tiny_llama: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu", **ENGINE))


def _front(core: EngineCore, tiny_llama: Path) -> ProcessEngine:
    front = ProcessEngine(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu", **ENGINE))
    front._client = _Client()  # type: ignore[assignment]
    front._input_processor = InputProcessor(front.tokenizer, core.info, 0)
    return front


def _add(front: ProcessEngine, params: SamplingParams) -> Any:
    return asyncio.run(front.add([front.tokenizer.encode(PROMPT)], [params], "cmpl"))


def _final(group: Any) -> RequestOutput:
    outs = []
    while not group._queue.empty():
        outs.append(group._queue.get_nowait()[1])
    assert outs and outs[-1].finished
    return outs[-1]


@pytest.mark.parametrize("ends", ["stopped by the front", "by length, before the stop arrived"])
def test_tokens_the_core_made_before_the_stop_reached_it_are_taken_back(
    core: EngineCore, tiny_llama: Path, ends: str
) -> None:
    front = _front(core, tiny_llama)
    client: _Client = front._client  # type: ignore[assignment]
    sockets = [_Socket(), _Socket()]
    loop = CoreLoop(core, SimpleNamespace(), sockets)  # type: ignore[arg-type]

    # The reference: the same request, to its end.
    group = _add(front, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    loop._handle(client.take())
    while core.has_unfinished_requests():
        loop._step()
    front._handle(sockets[0].take())
    tokens = _final(group).outputs[0].token_ids
    stop, num_kept = stop_inside_a_step(front.tokenizer, tokens, [2] * 6)

    before = core.stats["num_generation_tokens"]
    # Ended by length on the token after the stop string's: in the step the core runs before the stop reaches it.
    max_tokens = num_kept + 1 if ends.startswith("by length") else 60
    group = _add(front, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop=[stop]))
    (add,) = client.take()
    assert isinstance(add, AddRequests)
    add.front = 1  # from the second of two API servers: what the core says of it goes there
    loop._handle([add])
    stops: list[Any] = []
    while not stops:
        loop._step()
        front._handle(sockets[1].take())
        stops = client.take()
    assert [type(m) for m in stops] == [StopRequests]
    out = _final(group)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == tokens[:num_kept]
    assert out.metrics.num_generation_tokens == num_kept

    loop._step()  # the race: the core runs the request once more before the stop arrives
    late = sockets[1].take()
    assert sum(len(o.new_token_ids) for m in late if isinstance(m, StepOutputs) for o in m.outputs) == 1
    assert core.stats["num_generation_tokens"] - before == num_kept + 1
    front._handle(late)
    loop._handle(stops + client.take())  # the stop, and what the front took back since
    assert not core.has_unfinished_requests()
    loop._turn()  # the core's next turn: it says it has stopped the request (if it had not ended it itself)
    front._handle(sockets[1].take())
    loop._turn()
    assert client.take() == [], "the front took back more"
    assert not [o for m in sockets[0].take() + sockets[1].take() for o in m.outputs]

    assert core.stats["num_generation_tokens"] - before == num_kept
    assert front._stopped == {} and loop._front_of == {} and front._routes == {}
    assert core.kv.num_used_blocks == 0 and front.output_processor.states == {}
