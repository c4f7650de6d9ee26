"""Trace-driven simulation of confidence-scheduled verification: which verify policy gives the most tokens per
second on a cost curve, at each concurrency, without running a model (docs/scheduling.md).

A trace (JSONL, recorded by the engine with a fixed k, so every draft's fate is observed) holds, per request and
step, the calibrated confidences of its drafts and how many the target accepted. The simulator replays those blocks
in C slots, one block per slot per step, and asks each policy how many drafts of each block it would verify.
Verifying l drafts of a block whose first L survive yields min(l, L) + 1 tokens (coupled verification: the same
uniforms decide every policy's outcome); the step costs cost.step_ms(R, R + sum of l), no-spec verify_ms(R) alone.

- The block sequence, the EMA and the prior do not depend on the policy, so every policy replays the same steps and
  their differences are paired, not sampling noise. The EMA (smooth_confidences, per position) and the prior
  (initial_prior, update_prior) are the planner's, from speculative/budget.py.
- Simplifications: steps are decode-only (T = R: the trace's num_other_tokens is not replayed), and a block is what
  the engine drafted after its fixed-k step, whatever the simulated policy verified before it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dspark.errors import ConfigError
from dspark.speculative.budget import (
    allocate,
    choose_budget,
    choose_budget_sync,
    drafting_verdict,
    initial_prior,
    smooth_confidences,
    survival,
    update_prior,
)
from dspark.speculative.cost_model import CostModel
from dspark.speculative.trace import Trace

CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
EMA_ALPHAS = (0.0, 0.5, 0.8, 0.9)
WARMUP_STEPS = 64  # replayed before measuring, so every slot starts mid-request with a warm EMA and prior
CONFIDENCE_POLICIES = ("adaptive-async", "adaptive-sync", "threshold", "smartspec")  # report predicted - realised


# ---- policies -----------------------------------------------------------------------------------------------------


@dataclass
class StepInputs:
    """What a policy sees for one simulated step of R slots."""

    live: torch.Tensor  # [R, K] survivals of this block's smoothed confidences; 0 where no draft
    stale: torch.Tensor  # [R, K] survivals of the previous block's (a prior for a first block); 0 where no draft
    num_drafts: torch.Tensor  # [R] int64
    accepted: torch.Tensor  # [R] int64: the true L (only the oracle looks)


Policy = Callable[[StepInputs, CostModel], torch.Tensor]  # -> [R] int64 drafts to verify, each a prefix


def no_spec(step: StepInputs, cost: CostModel) -> torch.Tensor:
    return torch.zeros_like(step.num_drafts)


def fixed_k(k: int) -> Policy:
    def choose(step: StepInputs, cost: CostModel) -> torch.Tensor:
        return step.num_drafts.clamp(max=k)

    return choose


def adaptive_async(step: StepInputs, cost: CostModel) -> torch.Tensor:
    """The engine's default: the budget from stale survivals, the slots from live ones."""
    num_reqs = step.num_drafts.numel()
    return allocate(step.live, choose_budget(step.stale, num_reqs, num_reqs, cost))


def adaptive_sync(step: StepInputs, cost: CostModel) -> torch.Tensor:
    num_reqs = step.num_drafts.numel()
    return choose_budget_sync(step.live, num_reqs, num_reqs, cost)


def threshold_policy(tau: float) -> Policy:
    def choose(step: StepInputs, cost: CostModel) -> torch.Tensor:
        has = torch.arange(step.live.shape[1])[None, :] < step.num_drafts[:, None]
        return ((step.live >= tau) & has).sum(dim=1)  # survivals never increase: a prefix

    return choose


def smartspec(step: StepInputs, cost: CostModel) -> torch.Tensor:
    """One k for the whole batch, the one with the best expected goodput on stale survivals (SmartSpec-style)."""
    num_reqs, k = step.stale.shape
    ks = torch.arange(k + 1)
    gains = num_reqs + torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(step.stale.double().sum(0), 0)])
    tokens = num_reqs + torch.minimum(ks[:, None], step.num_drafts[None, :]).sum(dim=1)
    best = int(torch.argmax(gains / cost.step_ms(num_reqs, tokens)))
    return step.num_drafts.clamp(max=best)


def oracle(step: StepInputs, cost: CostModel) -> torch.Tensor:
    """Verifies only drafts it knows survive; the budget is the global argmax of tokens per millisecond."""
    num_reqs, k = step.live.shape
    budgets = torch.arange(int(step.accepted.sum()) + 1)
    best = int(torch.argmax((num_reqs + budgets) / cost.step_ms(num_reqs, num_reqs + budgets)))
    known = (torch.arange(k)[None, :] < step.accepted[:, None]).double()
    return allocate(known, best)  # NOTE: all values equal, so slots go position-major: each request a prefix


def policy_names(k: int) -> list[str]:
    return ["no-spec", *(f"fixed-{i}" for i in range(1, k + 1)), *CONFIDENCE_POLICIES, "oracle"]


def get_policy(name: str, tau: float = 0.5) -> Policy:
    named: dict[str, Policy] = {
        "no-spec": no_spec,
        "adaptive-async": adaptive_async,
        "adaptive-sync": adaptive_sync,
        "threshold": threshold_policy(tau),
        "smartspec": smartspec,
        "oracle": oracle,
    }
    if name in named:
        return named[name]
    k = name.removeprefix("fixed-")
    if k != name and k.isdigit() and int(k) >= 1:
        return fixed_k(int(k))
    raise ConfigError("policy", name, f"one of {', '.join(named)} or fixed-<k>")


# ---- simulation ---------------------------------------------------------------------------------------------------


def ema_update(
    state: torch.Tensor,  # [R, K] smoothed confidences so far
    known: torch.Tensor,  # [R, K] bool: positions that have a smoothed value
    current: torch.Tensor,  # [R, K] this block's confidences
    has: torch.Tensor,  # [R, K] bool: positions holding a draft this block
    alpha: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of the per-position EMA: a draft's position blends into its smoothed value (or starts it); a
    position without a draft this block keeps the value it had."""
    blended = torch.where(known, smooth_confidences(state, current, alpha), current)
    return torch.where(has, blended, state), known | has


def _drafts_at_all(policies: Sequence[str], step: StepInputs, counts: torch.Tensor, cost: CostModel) -> torch.Tensor:
    """[P] whether each policy runs the drafter this step. The adaptive modes ask drafting_verdict on stale survivals
    (as the engine does); SmartSpec drafts unless its batch-wide k is 0; the oracle drafts only when its known-good
    drafts beat no speculation; fixed k always drafts, no-spec never."""
    num_reqs = step.num_drafts.numel()
    out = []
    for name, c in zip(policies, counts, strict=True):
        if name == "no-spec":
            out.append(False)
        elif name in ("adaptive-async", "adaptive-sync"):
            out.append(drafting_verdict(step.stale, num_reqs, cost).draft)
        elif name == "smartspec":
            out.append(bool(c.sum() > 0))
        elif name == "oracle":
            tokens = num_reqs + int(c.sum())
            out.append(tokens / cost.step_ms(num_reqs, tokens) > num_reqs / cost.step_ms(0, num_reqs))
        else:
            out.append(True)
    return torch.tensor(out)


class _TabulatedCost(CostModel):
    """The same curves, read from a table of every token count a simulation can reach: a simulation asks for the
    same few costs hundreds of thousands of times."""

    def __init__(self, cost: CostModel, max_tokens: int, num_requests: int) -> None:
        super().__init__(cost.verify, cost.draft, cost.key)
        self.verify_table = cost.verify_ms(torch.arange(max_tokens + 1))  # [max_tokens + 1] fp64
        self.drafts = {0: 0.0, num_requests: cost.draft_ms(num_requests)}
        self.base = cost

    def verify_ms(self, num_tokens: torch.Tensor, context_tokens: int | None = None) -> torch.Tensor:
        return self.verify_table[num_tokens]

    def draft_ms(self, num_reqs: int) -> float:
        if num_reqs not in self.drafts:
            self.drafts[num_reqs] = self.base.draft_ms(num_reqs)
        return self.drafts[num_reqs]

    def step_ms(self, num_requests: int, num_tokens: Any, context_tokens: int | None = None) -> Any:
        if isinstance(num_tokens, torch.Tensor):
            return self.draft_ms(num_requests) + self.verify_table[num_tokens]
        return self.draft_ms(num_requests) + float(self.verify_table[num_tokens])


def simulate_policies(
    trace: Trace,
    cost: CostModel,
    policies: Sequence[str],
    concurrency: int,
    ema_alpha: float = 0.8,
    threshold: float = 0.5,
    steps: int | None = None,
    min_blocks: int = 2000,
    min_steps: int = 20,
) -> list[dict[str, Any]]:
    """Replay the trace in `concurrency` slots for `steps` steps (default: enough for min_blocks blocks, at least
    min_steps) under each policy; one result per policy, in order.

    The trace's streams lie end to end in a cycle; slot i starts at block i * N / C of it (so slots sharing a stream
    are at different points of it) and moves one block per step, a stream's first block resetting its EMA."""
    if concurrency < 1:
        raise ConfigError("concurrency", concurrency, "must be a positive integer")
    if not 0.0 <= ema_alpha < 1.0:
        raise ConfigError("ema_alpha", ema_alpha, "must be in [0, 1)")
    if steps is not None and steps < 1:
        raise ConfigError("steps", steps, "must be a positive integer")
    blocks = [b for stream in trace.streams.values() for b in stream]
    if not blocks:
        raise ConfigError("trace", trace.header, f"holds no fully observed block ({trace.num_censored} censored)")
    k, num_blocks = trace.K, len(blocks)
    conf_all = torch.zeros(num_blocks, k, dtype=torch.float64)  # [N, K]
    for i, b in enumerate(blocks):
        conf_all[i, : b.num_drafts] = torch.tensor(b.confidences, dtype=torch.float64)
    drafts_all = torch.tensor([b.num_drafts for b in blocks])  # [N]
    accepted_all = torch.tensor([b.accepted for b in blocks])  # [N]
    first_all = torch.tensor([j == 0 for stream in trace.streams.values() for j in range(len(stream))])  # [N]

    num_steps = steps if steps is not None else max(math.ceil(min_blocks / concurrency), min_steps)
    chosen = [(name, get_policy(name, threshold)) for name in policies]
    cost = _TabulatedCost(cost, concurrency * (k + 1), concurrency)
    # no-spec runs no drafter, so its step pays the target pass alone
    draft_ms = torch.tensor([0.0 if name == "no-spec" else cost.draft_ms(concurrency) for name in policies])  # [P]
    sums = {
        key: torch.zeros(len(policies), dtype=torch.float64) for key in ("ms", "verified", "pred", "real", "blocks")
    }
    positions = torch.arange(k)
    pointer = (torch.arange(concurrency) * num_blocks // concurrency - WARMUP_STEPS) % num_blocks
    state = torch.zeros(concurrency, k, dtype=torch.float64)
    known = torch.zeros(concurrency, k, dtype=torch.bool)
    prior = initial_prior(k)  # [K] survivals of a slot whose stream has held no draft yet, as the planner's
    for t in range(-WARMUP_STEPS, num_steps):
        conf, num_drafts, accepted = conf_all[pointer], drafts_all[pointer], accepted_all[pointer]
        has = positions[None, :] < num_drafts[:, None]
        known &= ~first_all[pointer][:, None]
        # as the planner's: the slot's smoothed survivals so far, or the prior while its stream has held no draft
        stale = torch.where(known[:, :1], survival(state), prior) * has
        state, known = ema_update(state, known, conf, has, ema_alpha)
        live = survival(state) * has  # every position before a draft holds one: updated this block
        prior = update_prior(prior, live[num_drafts > 0])
        pointer = (pointer + 1) % num_blocks
        if t < 0:
            continue
        step = StepInputs(live, stale, num_drafts, accepted)
        counts = torch.stack([policy(step, cost).to(torch.int64) for _, policy in chosen])  # [P, R]
        drafts = _drafts_at_all(policies, step, counts, cost)  # [P] bool: a policy may skip the drafter's pass
        counts = counts * drafts[:, None]
        verified = counts.sum(dim=1)  # [P]
        sums["ms"] += draft_ms * drafts + cost.verify_table[concurrency + verified]
        sums["verified"] += verified
        sums["pred"] += (live[None] * (positions[None, None, :] < counts[:, :, None])).sum(dim=(1, 2))
        sums["real"] += torch.minimum(counts, accepted[None, :]).sum(dim=1)
        sums["blocks"] += (counts > 0).sum(dim=1)

    results = []
    request_steps = num_steps * concurrency
    for i, name in enumerate(policies):
        ms, verified, pred, real, blocks_verified = (float(sums[key][i]) for key in sums)
        tokens = request_steps + real  # every request-step emits its bonus token
        report = name in CONFIDENCE_POLICIES
        results.append(
            {
                "policy": name,
                "concurrency": concurrency,
                "steps": num_steps,
                "ema_alpha": ema_alpha,
                "tokens": int(tokens),
                "ms": ms,
                "tokens_per_s": tokens / ms * 1e3,
                "mean_verify_len": verified / request_steps,
                "acceptance_length": tokens / request_steps,
                # predicted minus realised accepted drafts, per verified block and per verified draft
                "pred_minus_real": (pred - real) / blocks_verified if report and blocks_verified else None,
                "pred_minus_real_per_draft": (pred - real) / verified if report and verified else None,
            }
        )
    return results


def simulate(
    trace: Trace,
    cost: CostModel,
    policy: str,
    concurrency: int,
    ema_alpha: float = 0.8,
    threshold: float = 0.5,
    steps: int | None = None,
    min_blocks: int = 2000,
    min_steps: int = 20,
) -> dict[str, Any]:
    """One policy at one concurrency: tokens, ms, tokens_per_s, mean_verify_len, acceptance_length, pred_minus_real."""
    return simulate_policies(trace, cost, [policy], concurrency, ema_alpha, threshold, steps, min_blocks, min_steps)[0]


ROW_KEYS = ("policy", "concurrency", "tokens_per_s", "mean_verify_len", "acceptance_length", "pred_minus_real")


def run_all(
    trace: Trace,
    cost: CostModel,
    concurrencies: Sequence[int] = CONCURRENCIES,
    ema_alpha: float = 0.8,
    threshold: float = 0.5,
    steps: int | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Every policy at every concurrency, with its ratio to the oracle; plus a `best-fixed` row per concurrency
    (the fixed k with the most tokens/s there, its k in `k`)."""
    rows = []
    for c in tqdm(concurrencies, desc="simulate", unit="C", file=sys.stderr, leave=False, disable=not progress):
        results = simulate_policies(trace, cost, policy_names(trace.K), c, ema_alpha, threshold, steps)
        best_tps = next(r["tokens_per_s"] for r in results if r["policy"] == "oracle")
        group = [
            {**{key: r[key] for key in ROW_KEYS}, "ratio_to_oracle": r["tokens_per_s"] / best_tps} for r in results
        ]
        best = max((r for r in group if r["policy"].startswith("fixed-")), key=lambda r: r["tokens_per_s"])
        rows += [*group, {**best, "policy": "best-fixed", "k": int(best["policy"].removeprefix("fixed-"))}]
    return rows


def ema_study(
    trace: Trace,
    cost: CostModel,
    concurrencies: Sequence[int] = CONCURRENCIES,
    alphas: Sequence[float] = EMA_ALPHAS,
    steps: int | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """adaptive-async's predicted minus realised accepted drafts, per verified draft, for each EMA alpha: the alpha
    where it crosses zero is the one to trust (docs/scheduling.md, on smoothing)."""
    out = []
    grid = [(a, c) for a in alphas for c in concurrencies]
    for alpha, c in tqdm(grid, desc="ema study", file=sys.stderr, leave=False, disable=not progress):
        r = simulate(trace, cost, "adaptive-async", c, ema_alpha=alpha, steps=steps)
        out.append(
            {
                "alpha": alpha,
                "concurrency": c,
                "pred_minus_real_per_draft": r["pred_minus_real_per_draft"],
                "tokens_per_s": r["tokens_per_s"],
            }
        )
    return out


# ---- cost curves --------------------------------------------------------------------------------------------------


def b300_like(capture_limit: int = 512) -> CostModel:
    """A synthetic curve shaped like a large model on a B300-class GPU (not a measurement): verification flat at
    2 ms up to 64 tokens, +0.004 ms a token up to the capture limit, x1.6 just past it (eager steps), then linear;
    drafting 0.6 + 0.0015 ms a request."""
    if capture_limit < 1:
        raise ConfigError("capture_limit", capture_limit, "must be a positive integer")

    def verify(n: int) -> float:
        return 2.0 + 0.004 * max(0, n - 64)

    captured = sorted({1, 2, 4, *range(8, capture_limit + 1, 8), capture_limit})
    eager = [capture_limit + 1, *(capture_limit * m for m in (2, 4, 8, 16))]
    verify_ms = {n: verify(n) for n in captured} | {n: 1.6 * verify(n) for n in eager}
    draft_ms = {r: 0.6 + 0.0015 * r for r in captured + eager}
    return CostModel.from_points(verify_ms, draft_ms, capture_limit, key={"curve": "b300-like", "synthetic": True})


def measured(path: str | Path) -> CostModel:
    """A profiled cost model, as `dspark profile` saves it."""
    cost = CostModel.load(Path(path))
    if cost is None:
        raise ConfigError("cost", str(path), "b300 or a readable cost-model JSON file")
    return cost


def load_cost(spec: str) -> CostModel:
    return b300_like() if spec == "b300" else measured(spec)


def curve_name(spec: str) -> str:
    return "b300" if spec == "b300" else Path(spec).stem
