"""Step timing for adaptive verification: each step's measured time against the cost model's prediction, fed to the
online-refined cost model and to the regime chooser (speculative/regime.py). The engine core owns one StepTimer; the
planner owns what the measurements teach (its StepTiming, cost model and regime chooser).

Plain steps launched alone and drafting steps are timed by a pair of CUDA events (on CPU, the host clock), read back
only once the later one has completed, never with a sync. Continued steps (async scheduling: launched before their
predecessor was collected) are timed on the host from one's collection to the next's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dspark.speculative.cost_model import RefinedCostModel
from dspark.speculative.regime import RegimeChooser

if TYPE_CHECKING:
    from dspark.speculative.planner import VerificationPlanner

# CUDA: a plain step is timed only every few steps, except just after steps with drafts (a regime burst's plain steps
# must be measured): two timing events, their query and the bookkeeping are a visible share of a small plain step.
PLAIN_TIMING_EVERY = 4
TIMED_AFTER_DRAFTS = 4  # plain steps after a step with drafts that are always timed (at least a burst's length)


ENDING_MIN_SHARE = 0.2  # a step whose measured time is ending work beyond this share is not a measurement


def without_ending(measured_ms: float, ending_ms: float, shortened_ms: float = 0.0) -> float | None:
    """A step's measured time less the host time it spent ending requests, which every regime pays once per request,
    plus what the previous step's ending work took off this step's wait (async scheduling: the device ran this step
    while the host ended those requests). None where ending work was nearly all of the step: what is left is noise.

    Both ways of timing a step hold its ending work serially: a continued step's interval runs from the end of the
    previous step's processing to the end of this one's; an event pair spans the host's processing, during which the
    device has nothing queued (its next launch comes after)."""
    if not ending_ms and not shortened_ms:
        return measured_ms
    rest = measured_ms - ending_ms
    return rest + shortened_ms if rest >= ENDING_MIN_SHARE * measured_ms else None


@dataclass
class _Timed:
    num_requests: int
    base_ms: float  # the profiled curves' prediction
    refined_ms: float  # with the online overhead term
    start: torch.cuda.Event | float
    end: torch.cuda.Event | float
    verified_drafts: bool
    drafted: bool
    num_emitted: int
    decode_only: bool  # every request fed one token besides its drafts (no prompt chunk)
    ending_ms: float = 0.0  # host time the step spent ending requests: taken out of its measured time
    expected: tuple[float, int] | None = None  # its verified drafts' expected and accepted counts (planner.record)


@dataclass
class StepTiming:
    """Predicted vs measured step times, for the profiled curves and for the online-refined ones. On CUDA the
    measurement is a pair of events, read back only once the later one has completed (never a sync)."""

    pending: deque[_Timed] = field(default_factory=deque)
    num_steps: int = 0
    sum_error: list[float] = field(default_factory=lambda: [0.0] * 4)  # floats: a tensor op per step costs more

    def harvest(self, cost: RefinedCostModel, regime: RegimeChooser) -> None:
        while self.pending:
            t = self.pending[0]
            if isinstance(t.end, torch.cuda.Event):
                if not t.end.query():
                    return
                assert isinstance(t.start, torch.cuda.Event)
                measured = t.start.elapsed_time(t.end)
            else:
                measured = (t.end - float(t.start)) * 1e3
            self.pending.popleft()
            kept = without_ending(measured, t.ending_ms)
            if kept is None:
                continue
            measured = kept
            base = (t.base_ms - measured) / max(measured, 1e-6)
            refined = (t.refined_ms - measured) / max(measured, 1e-6)
            self.num_steps += 1
            self.sum_error = [
                a + b for a, b in zip(self.sum_error, (base, abs(base), refined, abs(refined)), strict=True)
            ]
            # NOTE: the speculative residual learns from steps that drafted (after verifying or not): a step that only
            # verified, leaving a drafting run, has no drafting pass, and averaged in it would make drafting look cheap.
            # Such steps teach neither residual.
            if t.drafted or not t.verified_drafts:
                cost.observe(t.num_requests, t.base_ms, measured, speculative=t.drafted)
            # A step with a prompt chunk says nothing about either regime's decode rate: counted as a plain step, a
            # level's first step (its requests' prefill) would make plain decoding look slower than drafting.
            if t.decode_only:
                regime.observe(
                    t.num_requests, t.verified_drafts, t.drafted, t.num_emitted, measured, expected=t.expected
                )

    def mean_errors(self) -> list[float]:
        """Mean relative error (predicted - measured) / measured: profiled, |profiled|, refined, |refined|."""
        return [e / self.num_steps for e in self.sum_error] if self.num_steps else [0.0] * 4


class StepTimer:
    """Times the engine's steps for the planner's cost model and regime chooser (adaptive modes; a no-op otherwise).

    The core calls step_started() before planning a step it launches alone, skip_timing() where a step must not be
    measured (the next one was launched before it was collected), and step_finished() or continued_step_finished()
    once the step's outputs are processed and its drafting (if any) is queued."""

    def __init__(self, planner: VerificationPlanner) -> None:
        self.planner = planner
        self._step_start: float | torch.cuda.Event | None = None
        self.plain_timing_every = PLAIN_TIMING_EVERY if planner.device.type == "cuda" else 1
        self._since_drafts = TIMED_AFTER_DRAFTS + 1  # steps since one with drafts to verify
        self._since_timed = 0
        self._last_continued: float | None = None  # when the last continued step was collected, in a run of them
        # The last step's ending work and wait: its ending work may have taken some of the next continued step's wait
        # (None: unknown, so the next continued step is not measured).
        self._before: tuple[float, float] | None = (0.0, 0.0)

    def step_started(self) -> None:
        """Before planning: the step's measured time includes the planning."""
        if not self.planner.adaptive:
            return
        self._since_drafts = 0 if self.planner.has_pending_drafts else self._since_drafts + 1
        self._since_timed += 1
        if self._since_drafts > TIMED_AFTER_DRAFTS and self._since_timed < self.plain_timing_every:
            self._step_start = None  # a plain step in a run of them: not timed (PLAIN_TIMING_EVERY)
            return
        self._since_timed = 0
        if self.planner.device.type == "cuda":
            self._step_start = torch.cuda.Event(enable_timing=True)
            self._step_start.record()
        else:
            self._step_start = time.perf_counter()

    def step_finished(
        self, drafted: bool, num_emitted: int, chain_starts: bool = False, ending_ms: float = 0.0, wait_ms: float = 0.0
    ) -> None:
        """After the step's drafting: its measured time against the cost model's prediction for what it ran (the
        target pass, and the drafter's pass if it drafted), which also refines the model online.

        chain_starts: the next step was launched before this one was collected (async scheduling), so this one is not
        timed; the next is, from now, as continued steps are timed from one another (continued_step_finished).
        Without it the first continued step of every pipelined run would go unmeasured, and a regime burst of plain
        steps (a switching step, then two plain ones, the first launched alone) would measure none, leaving a level
        whose model says draft without a plain rate.

        ending_ms: the host time the step spent ending requests (engine._process), not part of either regime's cost.
        wait_ms: the host's wait for the step's outputs (the runner's collect). With async scheduling the device runs
        the next step during this one's ending work, so that step waits less, and its time is short by as much; see
        continued_step_finished. A step launched alone waits for its whole device time, which says nothing of the
        next step's usual wait: after one that ended requests, the first continued step is not measured."""
        self._last_continued = time.perf_counter() if chain_starts else None
        self._before = None if ending_ms else (0.0, wait_ms)
        planner, planned = self.planner, self.planner.planned
        expected, planner.verified_expectation = planner.verified_expectation, None  # this step's, whether timed or not
        cost = planner.cost
        if planned is None or self._step_start is None or cost is None:
            return
        num_requests, num_tokens = planned.num_sampling, planned.num_tokens
        base = cost.base.step_ms(num_requests if drafted else 0, num_tokens)
        if drafted:
            refined = base + cost.overhead_ms(num_requests)
        else:  # the plain prediction with its floor, as planning uses it
            refined = cost.plain_step_ms(num_requests, num_tokens)
        if isinstance(self._step_start, torch.cuda.Event):
            end: torch.cuda.Event | float = torch.cuda.Event(enable_timing=True)
            end.record()  # type: ignore[union-attr]
        else:
            end = time.perf_counter()
        timed = _Timed(
            num_requests,
            base,
            refined,
            self._step_start,
            end,
            planned.verified_drafts,
            drafted,
            num_emitted,
            planned.decode_only,
            ending_ms,
            expected if planned.verified_drafts else None,
        )
        planner.timing.pending.append(timed)
        planner.timing.harvest(cost, planner.regime)
        self._step_start = planner.planned = None

    def skip_timing(self) -> None:
        """The step is not timed: the next step was launched before it was collected (async scheduling), so its
        measured time would hold that launch."""
        self._step_start = self.planner.planned = None
        self._last_continued = None
        self._before = (0.0, 0.0)

    def continued_step_finished(
        self,
        num_requests: int,
        num_emitted: int,
        chain_goes_on: bool,
        drafted: bool,
        ending_ms: float = 0.0,
        wait_ms: float = 0.0,
        num_verified: int = 0,
    ) -> None:
        """A continued step (async scheduling: launched before its predecessor was collected) was collected. A plain
        continued step verifies no drafts; a pipelined one (worker/spec_pipeline.py) verified num_verified. Their cost
        is the host wall time from one's collection to the next's (the device runs one while the host processes the
        other, so no pair of events brackets a step). A plain one feeds the plain
        regime's rate and the cost model's plain residual; one that drafted (the regime chose to draft after it, ending
        the run) switches regime and is not a measurement of either regime's rate, but feeds the speculative
        residual.

        ending_ms, wait_ms: as step_finished's. The previous step's ending work ran while the device ran this step,
        so this step waited less than the previous one did, by at most that work: what its wait lost is given back to
        its time: with the ending work only taken out of the step that did it, that step would read D and the next
        D - ending, a bias to high plain rates."""
        now = time.perf_counter()
        before, self._before = self._before, (ending_ms, wait_ms)
        start, self._last_continued = self._last_continued, now if chain_goes_on else None
        planner, cost = self.planner, self.planner.cost
        expected, planner.verified_expectation = planner.verified_expectation, None
        if start is None or not planner.adaptive or cost is None:
            return
        planner.timing.harvest(cost, planner.regime)  # older event-timed steps first: the regime sees them in order
        if before is None:  # what the previous step's ending work took from this one is unknown
            return
        shortened = min(before[0], max(0.0, before[1] - wait_ms))
        ms = without_ending((now - start) * 1e3, ending_ms, shortened)
        if ms is None:  # nearly all ending work
            return
        planner.regime.observe(
            num_requests, num_verified > 0, drafted, num_emitted, ms, expected=expected if num_verified else None
        )
        # And the cost model: what a plain step costs in a pipelined run (its host work overlaps the device's, unlike
        # the profiled step run alone) is what drafting must beat; one that drafted is the first step of a drafting
        # run, priced as the profile's plain pass plus drafting. Measuring that first step lets a run that should not
        # draft end after it, not after the next step's timing. Only below OUTLIER_RATIO: a first step at 5x its
        # refined prediction or more waits for a second one.
        base = cost.base
        if drafted:
            cost.observe(num_requests, base.step_ms(num_requests, num_requests + num_verified), ms, True)
        else:
            cost.observe(num_requests, base.plain_step_ms(num_requests, num_requests), ms, False)
