"""Start-up profiling of the step-cost curves adaptive verification plans with (docs/scheduling.md, on the cost model).

Dummy steps run through the real runner: drafting for R requests (draft_ms), then a verify step of n tokens
(verify_ms): ceil(n / (K + 1)) requests, each its last token plus up to K drafts, over a fixed synthetic context,
with the same sampling, verification and drafter-context work as a real step. After a warm-up, rounds time every
grid point once in turn (at least `runs` rounds), and each point's median is kept. The dummy requests borrow the
first blocks of the (still empty) KV cache: what they write there is garbage no real request ever reads, as every
block is written before it is read.

The result is saved as JSON under $DSPARK_CACHE/cost_models/, keyed by everything that changes the curve (model,
drafter, device, dtype, K, grid, threads), and reused on the next start.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dspark.config import SamplingParams
from dspark.core.request import Request
from dspark.core.scheduler import ScheduledRequest, SchedulerOutput
from dspark.models.registry import cache_dir
from dspark.speculative.cost_model import CostModel
from dspark.utils.progress import track
from dspark.worker.model_runner import ModelRunner

CONTEXT_TOKENS = 128  # the synthetic context every dummy request has (the curves ignore context length for now)
# Eager CPU steps are flat for a few tokens, then linear: a coarse grid (powers of 4) and 3 runs describe them, and
# keep the one-off start-up cost to seconds, since a large CPU step is slow.
CPU_MAX_TOKENS = 256
CPU_MAX_REQUESTS = 64
CPU_RUNS = 3
MIN_PROFILE_S = 1.5  # rounds go on (up to MAX_ROUNDS_FACTOR x runs) while they took less than this in all
MAX_ROUNDS_FACTOR = 5


def token_grid(max_tokens: int, capture_sizes: list[int] | None = None, coarse: bool = False) -> list[int]:
    """Every captured size (if any), then powers of two with 1.5x points between them (coarse: powers of four), and
    the maximum itself."""
    sizes = set(capture_sizes or [])
    n = 1
    while n < max_tokens:
        sizes.update({n} if coarse else {n, min(max_tokens, n + n // 2)})
        n *= 4 if coarse else 2
    sizes.add(max_tokens)
    return sorted(s for s in sizes if 1 <= s <= max_tokens)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def cost_model_path(key: dict[str, Any]) -> Path:
    """$DSPARK_COST_MODELS (or $DSPARK_CACHE/cost_models)/<hash of the key>.json."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = os.environ.get("DSPARK_COST_MODELS")
    return (Path(root) if root else cache_dir() / "cost_models") / f"{digest}.json"


class CostProfiler:
    def __init__(self, runner: ModelRunner, num_spec_tokens: int, runs: int = 5) -> None:
        self.runner = runner
        self.k = num_spec_tokens
        self.runs = runs
        self.device = runner.device
        vocab = runner.model.config.vocab_size
        # Tokens are arbitrary but fixed, and varied so the n-gram drafter finds matches as it would in text.
        g = torch.Generator().manual_seed(0)
        self.context = torch.randint(0, vocab, (CONTEXT_TOKENS,), generator=g).tolist()
        lookahead = runner.drafter.num_lookahead_tokens if runner.drafter is not None else 0
        num_blocks = math.ceil((CONTEXT_TOKENS + self.k + 1 + lookahead) / runner.block_size)
        self.block_ids = list(range(num_blocks))
        self._counter = 0

    def _requests(self, n: int) -> list[Request]:
        reqs = []
        for _ in range(n):
            self._counter += 1
            req = Request(
                f"profile-{self._counter}", None, list(self.context), SamplingParams(max_tokens=None), 0, None
            )
            req.num_computed_tokens = CONTEXT_TOKENS - 1
            req.block_ids = self.block_ids  # shared: the dummy steps only need somewhere to read and write
            reqs.append(req)
        return reqs

    def _once(self, fn: Callable[[], object]) -> float:
        """Milliseconds of one run of fn."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - start) * 1e3

    def _draft_step(self, num_reqs: int) -> tuple[Callable[[], object], list[Request]]:
        reqs = self._requests(num_reqs)
        return (lambda: self.runner.propose(reqs)), reqs

    def _verify_step(self, num_tokens: int) -> tuple[Callable[[], object], list[Request]]:
        num_reqs = math.ceil(num_tokens / (self.k + 1))
        reqs = self._requests(num_reqs)
        drafts = [min(self.k, num_tokens - r * (self.k + 1) - 1) for r in range(num_reqs)]
        if self.runner.drafter is not None:
            self.runner.propose(reqs)  # the distributions probabilistic verification reads

        flush = getattr(self.runner.drafter, "flush_context", None)

        def step() -> None:
            sched = SchedulerOutput(
                [ScheduledRequest(req, 1 + n, self.context[1 : 1 + n]) for req, n in zip(reqs, drafts, strict=True)]
            )
            self.runner.execute(sched)
            if flush is not None:  # a deferred context write is this step's cost, not the next drafting point's
                flush()

        return step, reqs

    def _release(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.runner.release(req.request_id)

    def profile(
        self, token_sizes: list[int], request_sizes: list[int], capture_limit: int, key: dict[str, Any]
    ) -> CostModel:
        """Every grid point's median over rounds that take each point once in turn: a burst of load from elsewhere
        on a shared machine lands on one run of every size, not on every run of one (timed one size after another,
        one noisy burst once made 4 drafts look 24% dearer than 1 on CPU, and n-gram then never drafted). At least
        `runs` rounds; more while they take under MIN_PROFILE_S in all (cheap grids: small CPU steps)."""
        steps = [("verify", n, *self._verify_step(n)) for n in token_sizes]
        if self.runner.drafter is not None:
            steps += [("draft", r, *self._draft_step(r)) for r in request_sizes]
        for _, _, fn, _ in steps:
            fn()  # warm-up
        times: dict[tuple[str, int], list[float]] = {(kind, n): [] for kind, n, _, _ in steps}
        started = time.perf_counter()
        for i in track(range(self.runs * MAX_ROUNDS_FACTOR), "profiling step costs", unit="round"):
            if i >= self.runs and time.perf_counter() - started > MIN_PROFILE_S:
                break
            for kind, n, fn, reqs in steps:
                times[(kind, n)].append(self._once(fn))
                if kind == "draft":  # its [R, k, vocab] distributions, not kept for every drafting point at once
                    for req in reqs:
                        self.runner.release(req.request_id, finished=False)
        for _, _, _, reqs in steps:
            self._release(reqs)
        verify = {n: statistics.median(times[("verify", n)]) for n in token_sizes}
        draft = {1: 0.0}
        if self.runner.drafter is not None:
            draft = {r: statistics.median(times[("draft", r)]) for r in request_sizes}
        return CostModel.from_points(verify, draft, capture_limit, key)


def load_or_profile(
    runner: ModelRunner,
    num_spec_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    identity: dict[str, Any],  # model, drafter, dtype: what else changes the curve
    capture_sizes: list[int] | None = None,
    log: Callable[[str], None] | None = None,
) -> CostModel:
    """The cost model for this engine: from the cache when profiled before with the same key, else profiled now."""
    max_tokens = min(max_num_batched_tokens, max_num_seqs * (num_spec_tokens + 1))
    max_reqs = max_num_seqs
    cpu = runner.device.type == "cpu"
    if cpu:
        max_tokens, max_reqs = min(max_tokens, CPU_MAX_TOKENS), min(max_reqs, CPU_MAX_REQUESTS)
    token_sizes = token_grid(max_tokens, capture_sizes, coarse=cpu)
    request_sizes = token_grid(max_reqs, coarse=cpu)
    runs = CPU_RUNS if cpu else 5
    capture_limit = max(capture_sizes) if capture_sizes else 0
    key = {
        **identity,
        "device": device_name(runner.device),
        "K": num_spec_tokens,
        "token_grid": token_sizes,
        "request_grid": request_sizes,
        "capture_limit": capture_limit,
        "context_tokens": CONTEXT_TOKENS,
        "threads": torch.get_num_threads(),
        "runs": runs,
        "rounds": f"interleaved, >= {MIN_PROFILE_S} s, <= {MAX_ROUNDS_FACTOR}x runs",  # what older caches lack
        "context_write": "in the verify step",
    }
    path = cost_model_path(key)
    cached = CostModel.load(path, key)
    if cached is not None:
        return cached
    if log is not None:
        log(f"profiling step costs for adaptive verification ({len(token_sizes)} token sizes); cached at {path}")
    model = CostProfiler(runner, num_spec_tokens, runs).profile(token_sizes, request_sizes, capture_limit, key)
    model.save(path)
    return model
