"""The start-up cost profile (worker/profiler.py) on a fake runner with known step times and a burst of load."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dspark.worker import profiler


class _Runner:
    """A runner whose verify step of n tokens takes ms_per_token * n ms and whose drafting takes 1 ms; while burst
    calls remain, each timed call takes BURST_MS more (another tenant's burst on a shared machine)."""

    BURST_MS = 25.0

    def __init__(self, burst_calls: int) -> None:
        self.device = torch.device("cpu")
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=1000))
        self.flushes = 0
        self.drafter = SimpleNamespace(num_lookahead_tokens=0, flush_context=self._flush)
        self.block_size = 16
        self.burst_calls = burst_calls
        self.warm = 0
        self.sizes: list[int] = []

    def _sleep(self, ms: float) -> None:
        if self.warm < 0 and self.burst_calls > 0:  # after the warm-up
            self.burst_calls -= 1
            ms += self.BURST_MS
        time.sleep(ms / 1e3)

    def execute(self, sched: Any) -> None:
        n = sum(s.num_new_tokens for s in sched.scheduled)
        self.sizes.append(n)
        self._sleep(2.0 * n)

    def _flush(self) -> None:
        self.flushes += 1

    def propose(self, reqs: list[Any]) -> None:
        self._sleep(1.0)

    def release(self, request_id: str, finished: bool = True) -> None:
        pass


def test_a_burst_of_load_does_not_skew_one_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds take every size once in turn: a burst as long as one round inflates one run of each size, and the
    medians keep the true step times (timed one size after another, the burst made the first size's every run
    slow)."""
    monkeypatch.setattr(profiler, "MIN_PROFILE_S", 0.0)
    runner = _Runner(burst_calls=4)  # one round: 3 verify sizes and 1 drafting size
    prof = profiler.CostProfiler(runner, num_spec_tokens=4, runs=3)  # type: ignore[arg-type]
    original_once = prof._once
    calls = {"n": 0}

    def once(fn: Any) -> float:
        runner.warm = -1  # the warm-up is over once timing starts
        calls["n"] += 1
        return original_once(fn)

    monkeypatch.setattr(prof, "_once", once)
    model = prof.profile([1, 4, 5], [1], 0, {})
    assert calls["n"] == 3 * 4  # 3 rounds of 4 points
    assert runner.sizes[:3] == [1, 4, 5] and runner.sizes[3:6] == [1, 4, 5]  # the warm-up, then rounds in turn
    # A skewed median would be a burst (25 ms) off; a 2 ms sleep overshot by 1.5 ms on a loaded 2-core CI machine
    tol = _Runner.BURST_MS / 5
    for n, expected in [(1, 2.0), (4, 8.0), (5, 10.0)]:
        assert model.verify.at(n) == pytest.approx(expected, abs=tol), n
    assert model.draft_ms(1) == pytest.approx(1.0, abs=tol)
    # Each verify step writes its deferred drafter context inside its own timing, not the next drafting point's.
    assert runner.flushes == len(runner.sizes)


def test_cheap_grids_take_more_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiler, "MIN_PROFILE_S", 0.2)
    runner = _Runner(burst_calls=0)
    prof = profiler.CostProfiler(runner, num_spec_tokens=4, runs=3)  # type: ignore[arg-type]
    prof.profile([1], [1], 0, {})
    rounds = len(runner.sizes) - 1  # less the warm-up
    assert 3 < rounds <= 3 * profiler.MAX_ROUNDS_FACTOR
