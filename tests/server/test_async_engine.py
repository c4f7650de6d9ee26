"""AsyncEngine over a scripted stand-in for LLMEngine (no model): outputs reach the right group and index, a refused
add adds nothing, a failing step fails its requests loudly and the thread goes on, a thread that dies says so to
everyone waiting, closing a group aborts its requests, and shutdown fails what is still waiting."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from dspark.config import SamplingParams
from dspark.errors import ConfigError
from dspark.outputs import CompletionOutput, RequestMetrics, RequestOutput
from dspark.server.async_engine import AsyncEngine, EngineDeadError, EngineError

REFUSED = 99  # max_tokens the fake engine refuses


class FakeEngine:
    """Each request emits one token per step until it has max_tokens; tokens are the step's number."""

    def __init__(self) -> None:
        self.tokenizer = None
        self.max_model_len = 64
        self.model_config = SimpleNamespace(vocab_size=100)
        self.left: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.num_steps = 0
        self.fail_steps: set[int] = set()
        self.fail_aborts = False

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str) -> str:
        if params.max_tokens == REFUSED:
            raise ConfigError("max_tokens", REFUSED, "refused by the test")
        self.left[request_id] = params.max_tokens or 1
        self.tokens[request_id] = []
        return request_id

    def abort_request(self, request_id: str | list[str]) -> None:
        if self.fail_aborts:
            raise RuntimeError("abort failed too")
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            if self.left.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self.num_steps in self.fail_steps:
            raise RuntimeError(f"step {self.num_steps} failed")
        outputs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            self.tokens[rid].append(self.num_steps)
            finished = self.left[rid] == 0
            if finished:
                del self.left[rid]
            outputs.append(_output(rid, self.tokens[rid], finished))
        return outputs

    def get_metrics(self) -> dict[str, Any]:
        return {"num_requests_running": len(self.left)}


def _output(rid: str, tokens: list[int], finished: bool) -> RequestOutput:
    completion = CompletionOutput(0, "", list(tokens), None, None, "length" if finished else None)
    metrics = RequestMetrics(0.0, None, None, None, 1, 0, len(tokens), 0)
    return RequestOutput(rid, None, [1], [completion], finished, metrics, new_token_ids=[tokens[-1]])


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


async def _drain(group: Any) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    async for i, out in group:
        tokens.setdefault(i, []).extend(out.new_token_ids)
    return tokens


def _run(test: Any) -> Any:
    async def main() -> Any:
        fake = FakeEngine()
        engine = AsyncEngine(fake)  # type: ignore[arg-type]
        engine.start()
        try:
            return await asyncio.wait_for(test(fake, engine), timeout=20)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_outputs_reach_their_group_and_index() -> None:
    async def test(fake: FakeEngine, engine: AsyncEngine) -> None:
        a = await engine.add([[1], [2]], [_params(3), _params(1)], "a")
        b = await engine.add([[3]], [_params(2)], "b")
        got_a, got_b = await asyncio.gather(_drain(a), _drain(b))
        assert {i: len(t) for i, t in got_a.items()} == {0: 3, 1: 1} and len(got_b[0]) == 2
        assert got_a[0] == sorted(got_a[0])  # in the engine's order
        engine.release(a)
        engine.release(b)
        assert engine.metrics() == {"num_requests_running": 0}

    _run(test)


def test_a_refused_add_adds_nothing() -> None:
    async def test(fake: FakeEngine, engine: AsyncEngine) -> None:
        with pytest.raises(ConfigError, match="refused by the test"):
            await engine.add([[1], [2]], [_params(5), _params(REFUSED)], "r")
        assert fake.aborted == ["r-0"] and not fake.left  # the first was added, then taken back

    _run(test)


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    async def test(fake: FakeEngine, engine: AsyncEngine) -> None:
        fake.fail_steps = {2}
        group = await engine.add([[1], [2]], [_params(5), _params(5)], "f")
        with pytest.raises(EngineError, match="RuntimeError: step 2 failed"):
            await _drain(group)
        assert sorted(fake.aborted) == ["f-0", "f-1"] and engine.num_step_errors == 1
        later = await engine.add([[1]], [_params(2)], "ok")
        assert len((await _drain(later))[0]) == 2
        assert engine.alive

    with caplog.at_level(logging.ERROR, logger="dspark.server"):
        _run(test)
    failures = [r for r in caplog.records if "engine step failed" in r.getMessage()]
    assert failures and failures[0].exc_info is not None  # the traceback is in the log


def test_a_dead_thread_fails_everyone_loudly(caplog: pytest.LogCaptureFixture) -> None:
    async def test(fake: FakeEngine, engine: AsyncEngine) -> None:
        fake.fail_steps, fake.fail_aborts = {1}, True  # the step fails, and so does aborting its requests
        group = await engine.add([[1]], [_params(5)], "d")
        with pytest.raises(EngineDeadError, match="died"):
            await _drain(group)
        assert not engine.alive
        with pytest.raises(EngineDeadError):
            await engine.add([[1]], [_params(1)], "after")

    with caplog.at_level(logging.CRITICAL, logger="dspark.server"):
        _run(test)
    assert any("engine thread died" in r.getMessage() and r.exc_info for r in caplog.records)


def test_close_aborts_what_has_not_finished() -> None:
    async def test(fake: FakeEngine, engine: AsyncEngine) -> None:
        group = await engine.add([[1], [2]], [_params(1), _params(10**6)], "c")
        first = await group.__anext__()
        assert first[0] in (0, 1)
        assert engine.release(group) >= 1
        for _ in range(100):
            if "c-1" in fake.aborted:
                break
            await asyncio.sleep(0.01)
        assert "c-1" in fake.aborted and not fake.left
        assert engine.release(group) == 0  # idempotent

    _run(test)


def test_shutdown_fails_what_is_waiting() -> None:
    async def main() -> None:
        fake = FakeEngine()
        engine = AsyncEngine(fake)  # type: ignore[arg-type]
        engine.start()
        group = await engine.add([[1]], [_params(10**6)], "s")
        await group.__anext__()
        await engine.shutdown()
        with pytest.raises(EngineDeadError, match="shutting down"):
            await _drain(group)
        assert fake.aborted == ["s-0"] and not engine.alive
        with pytest.raises(EngineDeadError):
            await engine.add([[1]], [_params(1)], "late")

    asyncio.run(asyncio.wait_for(main(), timeout=20))
