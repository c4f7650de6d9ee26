"""Confidence-scheduled verification: how many drafts the target verifies this step, and whose (DESIGN.md section 4).

- survival a_rj = prod_{i<=j} c_ri: the chance that request r's draft j survives, from calibrated confidences; never
  increasing along j. Verifying l_r drafts yields 1 + sum_{j<=l_r} a_rj tokens in expectation (the bonus always
  counts).
- choose_budget (host, on stale survivals): B* = argmax over B of (N_sampling + sum of the B largest survivals) /
  (draft_ms(R) + verify_ms(T + B)), a global argmax over every B (the cost curve is jagged: no early stop).
- allocate (device, on live survivals): the top-B* slots, ties broken by position then request index (never by
  value), as per-request counts 0..K. Whether a draft is verified then never depends on its own value: its survival
  depends only on the drafts before it, and a slot never ranks above an earlier slot of its own request.
- choose_budget_sync: the paper's Algorithm 1 on live survivals, greedy with its early stop (lossless only with it).
- smooth_confidences: the per-request, per-position EMA (alpha = 0 disables it).

This file is the maths only; the engine wires it in with the cost model (spec/cost_model.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CostFn = Callable[[torch.Tensor], torch.Tensor]  # token counts [n] int64 -> step milliseconds [n] fp64


def survival(confidences: torch.Tensor) -> torch.Tensor:
    """[R, K] calibrated confidences in [0, 1] -> [R, K] survivals (running products along K)."""
    return torch.cumprod(confidences.clamp(0.0, 1.0), dim=-1)


def smooth_confidences(previous: torch.Tensor | None, current: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * previous + (1 - alpha) * current, per position; previous None (a new request) or alpha 0: current."""
    if previous is None or alpha == 0.0:
        return current
    return alpha * previous + (1.0 - alpha) * current


def valid_slots(survivals: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """Survivals with slots past each request's cap (0..K drafts it may verify) set to 0: [R, K]."""
    positions = torch.arange(survivals.shape[1], device=survivals.device)
    return torch.where(positions[None, :] < caps[:, None], survivals, torch.zeros_like(survivals))


def choose_budget(
    survivals: torch.Tensor,  # [R, K] host, stale; invalid slots 0 (valid_slots)
    num_valid: int,  # how many slots are valid (the largest budget that means anything)
    num_sampling: int,  # requests that emit a token this step whatever B is
    num_tokens: int,  # T: the step's non-draft tokens
    num_draft_reqs: int,  # R for the draft cost
    verify_ms: CostFn,
    draft_ms: Callable[[int], float],
) -> int:
    """B*: the verification budget with the most expected tokens per millisecond (smallest B on ties)."""
    top = torch.sort(survivals.flatten().double(), descending=True).values[:num_valid]
    gains = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(top, 0)]) + num_sampling
    budgets = torch.arange(num_valid + 1, dtype=torch.int64)
    rate = gains / (draft_ms(num_draft_reqs) + verify_ms(num_tokens + budgets))
    return int(torch.argmax(rate))  # NOTE: argmax returns the first maximum: the cheapest of equal rates


def allocate(
    survivals: torch.Tensor,  # [R, K] live; invalid slots must already be excluded by caps
    caps: torch.Tensor,  # [R] int64: drafts each request may verify (0..K)
    budget: int,
) -> torch.Tensor:  # [R] int64 counts
    """Per-request draft counts from the top-`budget` valid slots. Ties: lower position first, then lower request.

    NOTE: slots are laid out position-major (index j * R + r) and sorted stably by value, so equal values keep that
    order: the tie-break never looks at a value, and a request's chosen slots are always a prefix."""
    num_reqs, k = survivals.shape
    positions = torch.arange(k, device=survivals.device)
    valid = positions[None, :] < caps[:, None]  # [R, K]
    values = torch.where(valid, survivals.float(), torch.full_like(survivals.float(), -1.0))
    flat = values.t().reshape(-1)  # position-major
    order = torch.sort(flat, descending=True, stable=True).indices
    budget = min(budget, int(valid.sum()))
    chosen = order[:budget]
    return torch.bincount(chosen % num_reqs, minlength=num_reqs)


def choose_budget_sync(
    survivals: torch.Tensor,  # [R, K] live; invalid slots 0
    caps: torch.Tensor,  # [R] int64
    num_sampling: int,
    num_tokens: int,
    num_draft_reqs: int,
    verify_ms: CostFn,
    draft_ms: Callable[[int], float],
) -> torch.Tensor:  # [R] int64 counts
    """Algorithm 1: add the best remaining slot while the rate improves; stop at the first slot that does not."""
    num_valid = int((torch.arange(survivals.shape[1])[None, :] < caps[:, None]).sum())
    order_values = torch.sort(valid_slots(survivals, caps).flatten().double(), descending=True).values
    base = draft_ms(num_draft_reqs)
    gain, budget = float(num_sampling), 0
    rate = gain / (base + float(verify_ms(torch.tensor([num_tokens]))[0]))
    for b in range(1, num_valid + 1):
        next_gain = gain + float(order_values[b - 1])
        next_rate = next_gain / (base + float(verify_ms(torch.tensor([num_tokens + b]))[0]))
        if next_rate <= rate:
            break  # NOTE: the early stop is what keeps the synchronous mode lossless
        gain, rate, budget = next_gain, next_rate, b
    return allocate(survivals, caps, budget)
