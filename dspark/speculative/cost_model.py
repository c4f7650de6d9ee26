"""Step-cost curves: how many milliseconds a target step of n tokens (verify_ms) and a draft step for r requests
(draft_ms) take on this machine, from profiled points (docs/scheduling.md, "The cost model").

- At or below the CUDA-graph capture limit a step is padded up to the next captured size, so the curve is a step
  function: the cost of the smallest profiled size >= n.
- Above the limit: linear interpolation between profiled points, linear extrapolation past the last one.
- Forced monotone (isotonic regression): a larger step never predicts cheaper, whatever the profiling noise.
- The interface takes the step's context size too (unused for now), so a context-aware curve needs no redesign.

Profiling itself (dummy steps at start-up, median of 5) and persistence are the engine's; a curve is data here:
points in, predictions out, JSON round trip.
"""

from __future__ import annotations

import bisect
import json
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch


def isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators).

    Not a running maximum, which would turn one slow profiling run (a GC pause, a clock dip) into a cliff that every
    larger size inherits; pooling averages the outlier with its neighbours instead."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


@dataclass
class CostCurve:
    sizes: list[int]  # profiled sizes, strictly increasing
    ms: list[float]  # measured milliseconds (medians), one per size
    capture_limit: int = 0  # sizes <= this are padded to the next profiled size (0: no step part)
    monotone_ms: list[float] = field(init=False)

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.ms):
            raise ValueError(f"a cost curve needs one time per size: {len(self.sizes)} sizes, {len(self.ms)} times")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:], strict=False)) or self.sizes[0] < 1:
            raise ValueError(f"sizes must be positive and strictly increasing, got {self.sizes}")
        if self.capture_limit and self.capture_limit not in self.sizes:
            raise ValueError(f"capture_limit={self.capture_limit} must be a profiled size")
        self.monotone_ms = isotonic(self.ms)

    def __call__(self, n: torch.Tensor, context_tokens: int | None = None) -> torch.Tensor:
        """Predicted milliseconds for sizes n ([m] int64) -> [m] fp64. context_tokens is accepted, not used yet.

        Monotone in n: the times are isotonic, interpolation between them never decreases, and the step
        part ends at a profiled size, where the linear part starts from the same value.

        Numpy on the host (the same float64 operations in the same order as `at`): the budget choice evaluates it
        for every candidate budget, R * K + 1 of them, where torch's per-op overhead would dominate."""
        sizes = np.asarray(self.sizes, dtype=np.float64)
        ms = np.asarray(self.monotone_ms, dtype=np.float64)
        x = n.detach().cpu().numpy().astype(np.float64)
        above = np.minimum(np.searchsorted(sizes, x), len(self.sizes) - 1)  # smallest profiled size >= n
        step = ms[above]
        if len(self.sizes) == 1:
            linear = ms[0] * x / sizes[0]  # one point: proportional
        else:
            hi = np.maximum(above, 1)
            lo = hi - 1
            linear = ms[lo] + (ms[hi] - ms[lo]) / (sizes[hi] - sizes[lo]) * (x - sizes[lo])
        out = np.where(x <= self.capture_limit, step, linear)
        return torch.from_numpy(np.asarray(np.maximum(out, ms[0])))  # never cheaper than the first profiled size

    def at(self, n: int) -> float:
        """The prediction for one size, in plain floats: what __call__ gives for [n], without building tensors (the
        planner asks once or twice a step, where a tensor round trip costs more than the arithmetic)."""
        sizes, ms = self.sizes, self.monotone_ms
        above = min(bisect.bisect_left(sizes, n), len(sizes) - 1)
        if n <= self.capture_limit:
            out = ms[above]
        elif len(sizes) == 1:
            out = ms[0] * n / sizes[0]
        else:
            hi = max(above, 1)
            lo = hi - 1
            out = ms[lo] + (ms[hi] - ms[lo]) / (sizes[hi] - sizes[lo]) * (n - sizes[lo])
        return max(out, ms[0])


@dataclass
class CostModel:
    verify: CostCurve  # by the step's token count
    draft: CostCurve  # by the number of drafting requests
    key: dict[str, Any] = field(default_factory=dict)  # model, device, dtype, K, capture grid: when it may be reused

    @classmethod
    def from_points(
        cls,
        verify_ms: dict[int, float],
        draft_ms: dict[int, float],
        capture_limit: int = 0,
        key: dict[str, Any] | None = None,
    ) -> CostModel:
        """Curves from profiled points; each curve's step part ends at its largest size within capture_limit."""

        def curve(points: dict[int, float]) -> CostCurve:
            sizes = sorted(points)
            limit = max((s for s in sizes if s <= capture_limit), default=0)
            return CostCurve(sizes, [float(points[s]) for s in sizes], limit)

        return cls(curve(verify_ms), curve(draft_ms), dict(key or {}))

    def verify_ms(self, num_tokens: torch.Tensor, context_tokens: int | None = None) -> torch.Tensor:
        return self.verify(num_tokens, context_tokens)

    def draft_ms(self, num_reqs: int) -> float:
        return self.draft.at(num_reqs) if num_reqs > 0 else 0.0

    @overload
    def step_ms(self, num_requests: int, num_tokens: int, context_tokens: int | None = None) -> float: ...
    @overload
    def step_ms(
        self, num_requests: int, num_tokens: torch.Tensor, context_tokens: int | None = None
    ) -> torch.Tensor: ...
    def step_ms(
        self, num_requests: int, num_tokens: int | torch.Tensor, context_tokens: int | None = None
    ) -> float | torch.Tensor:
        """Predicted milliseconds of a step: drafting for num_requests plus a target pass over num_tokens (an int,
        or a tensor of candidate token counts for a vector of predictions)."""
        if isinstance(num_tokens, torch.Tensor):
            return self.draft_ms(num_requests) + self.verify_ms(num_tokens.cpu(), context_tokens)
        return self.draft_ms(num_requests) + self.verify.at(num_tokens)

    def plain_step_ms(self, num_requests: int, num_tokens: Any, context_tokens: int | None = None) -> Any:
        """Predicted milliseconds of a plain step (no drafter pass) of num_requests requests over num_tokens tokens;
        the profiled curves see only the tokens."""
        del num_requests  # the refined model's residual needs it
        return self.step_ms(0, num_tokens, context_tokens)

    def table(self) -> list[dict[str, float]]:
        """The profiled points, for printing: one row per size with the verify and draft times where profiled."""
        sizes = sorted(set(self.verify.sizes) | set(self.draft.sizes))
        v = dict(zip(self.verify.sizes, self.verify.ms, strict=True))
        d = dict(zip(self.draft.sizes, self.draft.ms, strict=True))
        return [{"size": s, "verify_ms": v.get(s, float("nan")), "draft_ms": d.get(s, float("nan"))} for s in sizes]

    def save(self, path: Path) -> None:
        data = {
            "key": self.key,
            "verify": {k: v for k, v in asdict(self.verify).items() if k != "monotone_ms"},
            "draft": {k: v for k, v in asdict(self.draft).items() if k != "monotone_ms"},
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path, key: dict[str, Any] | None = None) -> CostModel | None:
        """The saved model when it was profiled for exactly this key (any key when None); None when absent, stale or
        unreadable."""
        try:
            data = json.loads(path.read_text())
            if key is not None and data.get("key") != key:
                return None
            return cls(CostCurve(**data["verify"]), CostCurve(**data["draft"]), data.get("key", {}))
        except (OSError, ValueError, TypeError, KeyError):
            return None


# A step measured slower than this multiple of its refined prediction is learned from only if the regime's previous
# step was such an outlier too: a one-off stall (a kernel compiling, a GC pause) says nothing about the next step, a
# regime that really costs that much says it twice (a drafting step at temperature 1 can cost several times its
# profile).
OUTLIER_RATIO = 5.0
SURPRISE = 0.25  # a speculative step measured this far (relative) from its refined prediction moves the verdicts
SPEC_LOADS = 8  # recent speculative steps whose request counts say at which loads drafting's cost was measured
# speculative steps learned from before a plain verdict carries the residual's predictions (which space a level's first
# drafting burst, regime.Verdict): an engine's first drafting steps pay first-call costs (kernel and primitive
# selection for new shapes, allocation), several in a row, so the outlier rule keeps only the first out. Learned from
# 1-3 of them, a residual priced drafting at 125 against plain's 41 ms at batch 1 on CPU (drafting cost ~38 ms), and
# the predictions put the first drafting burst ~500 steps away. Before then a plain verdict explores after FIRST_PERIOD.
MIN_SPEC_STEPS = 8
MIN_PLAIN_FRACTION = 0.5  # a plain step is never predicted below this share of its profiled time


class _Residual:
    """Measured minus profiled milliseconds as a + b * num_requests, by exponentially weighted least squares."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.count = 0  # steps learned from
        self._sums = [0.0] * 5  # sum of w, w*r, w*r^2, w*y, w*r*y (floats: updated every step, a tensor op costs more)

    def add(self, num_requests: int, residual_ms: float) -> None:
        r, y, d = float(num_requests), residual_ms, self.decay
        self._sums = [d * a + b for a, b in zip(self._sums, (1.0, r, r * r, y, r * y), strict=True)]
        self.count += 1

    def at(self, num_requests: int) -> float:
        s0, s1, s2, sy, sry = self._sums
        if s0 < 1e-9:
            return 0.0
        det = s0 * s2 - s1 * s1
        slope = (s0 * sry - s1 * sy) / det if det > 1e-6 * max(s0 * s2, 1e-12) else 0.0
        return (sy - slope * s1) / s0 + slope * num_requests


class RefinedCostModel(CostModel):
    """A profiled cost model plus what the profile cannot see, learned online from measured steps, for each regime.

    The profile times the runner alone (target pass, verification, drafting) on dummy greedy requests; a real step
    also pays per-request work outside it (scheduling, output processing, detokenising), real contexts and, at T > 0,
    the sampled drafts and verification. That residual, measured minus profiled, is fitted as a + b * num_requests by
    exponentially weighted least squares, separately for speculative steps (they drafted, after verifying or not) and
    plain ones (neither verified nor drafted), and added to each regime's predictions.

    NOTE: two residuals, not one: adding the same milliseconds to both sides of "does drafting pay" shrinks their
    ratio, which would lean the model towards drafting exactly where drafting costs most (high load, where a drafting
    step's host work is several times what the profile saw). Until a speculative step has been measured its residual
    is the plain one's.

    The speculative residual is measured at some loads and extrapolated to others. `measured_at_or_below` says whether
    a recent speculative step ran at this load or a lower one: then the prediction errs towards drafting being cheaper
    than it is (drafting only gets dearer with load), so a "plain" verdict from it can be trusted.

    A plain residual may be negative (a pipelined plain step, measured host to host, overlaps the host's work with the
    device's, where the profile times a step run alone), down to MIN_PLAIN_FRACTION of the profiled time; a speculative
    one is never below 0."""

    def __init__(self, base: CostModel, decay: float = 0.98) -> None:
        super().__init__(base.verify, base.draft, base.key)
        self.base = base
        self.plain = _Residual(decay)
        self.spec = _Residual(decay)
        self.num_surprises = 0  # speculative steps that differed from their refined prediction by more than SURPRISE
        self._outlier = {True: False, False: False}  # regime -> its last step was an outlier, not learned from
        self._spec_loads: deque[int] = deque(maxlen=SPEC_LOADS)

    def observe(self, num_requests: int, base_ms: float, measured_ms: float, speculative: bool) -> None:
        predicted = base_ms + self.overhead_ms(num_requests, speculative)
        if speculative:
            predicted = max(predicted, base_ms)
        else:
            predicted = max(predicted, MIN_PLAIN_FRACTION * base_ms)
        outlier = measured_ms > OUTLIER_RATIO * max(predicted, 1e-3)
        if outlier and not self._outlier[speculative]:
            self._outlier[speculative] = True
            return
        self._outlier[speculative] = False
        if speculative:
            self.num_surprises += abs(measured_ms - predicted) > SURPRISE * max(predicted, 1e-3)
            self._spec_loads.append(num_requests)
        (self.spec if speculative else self.plain).add(num_requests, measured_ms - base_ms)

    def measured_at_or_below(self, num_requests: int) -> bool:
        """Whether one of the last SPEC_LOADS speculative steps ran with at most num_requests requests, once at least
        MIN_SPEC_STEPS were learned from."""
        return self.spec.count >= MIN_SPEC_STEPS and any(r <= num_requests for r in self._spec_loads)

    def overhead_ms(self, num_requests: int, speculative: bool = True) -> float:
        if speculative:
            return max(0.0, (self.spec if self.spec.count else self.plain).at(num_requests))
        return self.plain.at(num_requests)

    def step_ms(self, num_requests: int, num_tokens: Any, context_tokens: int | None = None) -> Any:
        """A drafting step's predicted milliseconds (num_requests > 0), with the speculative residual; num_requests 0
        is a plain step of unknown width (the plain residual's intercept): plain_step_ms knows its requests."""
        if num_requests == 0:
            return self.plain_step_ms(0, num_tokens, context_tokens)
        return self.base.step_ms(num_requests, num_tokens, context_tokens) + self.overhead_ms(num_requests)

    def plain_step_ms(self, num_requests: int, num_tokens: Any, context_tokens: int | None = None) -> Any:
        base = self.base.plain_step_ms(num_requests, num_tokens, context_tokens)
        refined = base + self.overhead_ms(num_requests, speculative=False)
        if isinstance(refined, torch.Tensor):
            return torch.maximum(refined, MIN_PLAIN_FRACTION * base)
        return max(refined, MIN_PLAIN_FRACTION * base)
