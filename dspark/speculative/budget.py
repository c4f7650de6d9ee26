"""Confidence-scheduled verification: how many drafts the target verifies this step, and whose (docs/scheduling.md).

- survival a_rj = prod_{i<=j} c_ri: the chance that request r's draft j survives, from calibrated confidences; never
  increasing along j. Verifying l_r drafts yields 1 + sum_{j<=l_r} a_rj tokens in expectation (the bonus always
  counts). A slot that holds no draft has survival 0.
- choose_budget (host, on stale survivals): B* = argmax over B of (N_sampling + sum of the B largest survivals) /
  (draft_ms(R) + verify_ms(T + B)), a global argmax over every B (the cost curve is jagged: no early stop).
- allocate (device, on live survivals): the top-B* slots, ties broken by position then request index (never by
  value), as per-request counts 0..K. Whether a draft is verified then never depends on its own value: its survival
  depends only on the drafts before it, and a slot never ranks above an earlier slot of its own request.
- choose_budget_sync: the paper's Algorithm 1 on live survivals, greedy with its early stop (lossless only with it:
  a global argmax over live survivals would let a later slot's survival, which depends on the draft before it,
  decide whether that draft is verified).
- smooth_confidences: the per-request, per-position EMA (alpha = 0 disables it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark.speculative.cost_model import CostModel
from dspark.speculative.regime import Verdict


def survival(confidences: torch.Tensor) -> torch.Tensor:
    """[R, K] calibrated confidences in [0, 1] -> [R, K] survivals (running products along K)."""
    return torch.cumprod(confidences.clamp(0.0, 1.0), dim=-1)


def smooth_confidences(previous: torch.Tensor | None, current: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * previous + (1 - alpha) * current, per position; previous None (a new request) or alpha 0: current."""
    if previous is None or alpha == 0.0:
        return current
    return alpha * previous + (1.0 - alpha) * current


def slot_caps(survivals: torch.Tensor, max_per_request: torch.Tensor | None = None) -> torch.Tensor:
    """[R] drafts each request may verify: its slots with a draft (survival > 0, a prefix), within its cap."""
    held = (survivals > 0).sum(dim=1)
    return held if max_per_request is None else torch.minimum(held, max_per_request.to(held.device, held.dtype))


def choose_budget(
    survival: torch.Tensor,  # [R, K] host, stale; 0 where no draft
    num_sampling: int,  # requests that emit a token this step whatever B is (and draft after it)
    num_other_tokens: int,  # T: the step's non-draft tokens
    cost: CostModel,
    context_tokens: int | None = None,  # passed to the cost model (unused by today's curves)
) -> int:
    """B*: the verification budget with the most expected tokens per millisecond (the smallest B on ties)."""
    if survival.numel() <= SMALL_BUDGET_CHOICE:
        return _choose_budget_floats(survival, num_sampling, num_other_tokens, cost, context_tokens)
    return _choose_budget_arrays(survival, num_sampling, num_other_tokens, cost, context_tokens)


def _choose_budget_arrays(
    survival: torch.Tensor, num_sampling: int, num_other_tokens: int, cost: CostModel, context_tokens: int | None
) -> int:
    """choose_budget in numpy (the cost curve in torch, on a view of the same memory): on the host numpy's sort and
    sums cost less than torch's per-op overhead. The same sums in the same order as the float path."""
    values = survival.detach().to("cpu", torch.float64).numpy().ravel()
    top = -np.sort(-values[values > 0])  # descending
    gains = np.concatenate([np.zeros(1), np.cumsum(top)]) + num_sampling
    budgets = torch.arange(top.size + 1, dtype=torch.int64)
    rate = gains / cost.step_ms(num_sampling, num_other_tokens + budgets, context_tokens).numpy()
    return int(np.argmax(rate))  # NOTE: argmax returns the first maximum: the cheapest of equal rates


SMALL_BUDGET_CHOICE = 64  # survival slots up to which choose_budget runs on Python floats


def _choose_budget_floats(
    survival: torch.Tensor, num_sampling: int, num_other_tokens: int, cost: CostModel, context_tokens: int | None
) -> int:
    """choose_budget in plain floats, the same sums in the same order: for a few requests a dozen tensor ops cost
    more than the arithmetic."""
    top = sorted((v for v in survival.flatten().tolist() if v > 0), reverse=True)
    best, best_rate, gain = 0, -1.0, float(num_sampling)
    for budget in range(len(top) + 1):
        if budget:
            gain += top[budget - 1]
        rate = gain / cost.step_ms(num_sampling, num_other_tokens + budget, context_tokens)
        if rate > best_rate:  # the first maximum: the cheapest of equal rates, as torch.argmax
            best, best_rate = budget, rate
    return best


def allocate(
    survival: torch.Tensor,  # [R, K] live; 0 where no draft
    budget: int | torch.Tensor,  # B* (a host int, or a 0-d int tensor on the survivals' device)
    max_per_request: torch.Tensor | None = None,  # [R] int caps (0..K)
) -> torch.Tensor:  # [R] int64 counts, on the survivals' device
    """Per-request draft counts from the top-`budget` valid slots. Ties: lower position first, then lower request.

    On CUDA a Triton kernel (allocate_kernel.py) does this without leaving the device; here is its torch twin.
    NOTE: slots are laid out position-major (index j * R + r) and sorted stably by value, so equal values keep that
    order: the tie-break never looks at a value, and a request's chosen slots are always a prefix."""
    caps = slot_caps(survival, max_per_request)
    if survival.is_cuda:
        from dspark.speculative.allocate_kernel import allocate_triton
        from dspark.utils.platform import triton_available

        if triton_available():
            return allocate_triton(survival, budget, caps)
    return allocate_torch(survival, budget, caps)


def allocate_torch(survival: torch.Tensor, budget: int | torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    num_reqs, k = survival.shape
    positions = torch.arange(k, device=survival.device)
    valid = positions[None, :] < caps[:, None]  # [R, K]
    values = torch.where(valid, survival.float(), torch.full_like(survival, -1.0, dtype=torch.float32))
    flat = values.t().reshape(-1)  # position-major
    order = torch.sort(flat, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    chosen = (rank < torch.as_tensor(budget, device=survival.device)) & valid.t().reshape(-1)
    return torch.bincount(torch.arange(flat.numel(), device=survival.device)[chosen] % num_reqs, minlength=num_reqs)


def choose_budget_sync(
    survival: torch.Tensor,  # [R, K] live; 0 where no draft
    num_sampling: int,
    num_other_tokens: int,
    cost: CostModel,
    max_per_request: torch.Tensor | None = None,
    context_tokens: int | None = None,
) -> torch.Tensor:  # [R] int64 counts
    """Algorithm 1: add the best remaining slot while the rate improves; stop at the first slot that does not."""
    caps = slot_caps(survival, max_per_request)
    valid = torch.arange(survival.shape[1], device=survival.device)[None, :] < caps[:, None]
    values = torch.sort(survival.double()[valid].cpu(), descending=True).values
    gains = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(values, 0)]) + num_sampling
    rates = gains / cost.step_ms(num_sampling, num_other_tokens + torch.arange(values.numel() + 1), context_tokens)
    worse = (rates[1:] <= rates[:-1]).nonzero()
    # NOTE: the early stop is what keeps the synchronous mode lossless; the budget is where the rate first stops rising.
    budget = int(worse[0]) if worse.numel() else values.numel()
    return allocate(survival, budget, caps)


@dataclass
class FlatLayout:
    """A step's flattened batch, padded to num_tokens: request r owns rows query_start[r] .. query_start[r + 1] - 1."""

    query_start: torch.Tensor  # [R + 1] int32 (cu_seqlens); padding requests are empty
    positions: torch.Tensor  # [num_tokens] int64 (0 on padding rows)
    slots: torch.Tensor  # [num_tokens] int64: KV slots, -1 on padding rows (never written)
    owner: torch.Tensor  # [num_tokens] int64: each row's request (padding rows: the last request)
    offset: torch.Tensor  # [num_tokens] int64: each row's index among its request's rows
    seq_lens: torch.Tensor  # [R] int32: context length after the step (0 for empty requests)
    real: torch.Tensor  # [num_tokens] bool: rows that hold a token


def flat_layout(
    num_plain: torch.Tensor,  # [R] int: tokens each request feeds besides drafts (prompt chunk or last token; 0: none)
    counts: torch.Tensor,  # [R] int: drafts each request verifies (allocate)
    num_computed: torch.Tensor,  # [R] int: tokens already in its KV cache (the first position fed)
    block_tables: torch.Tensor,  # [R, max_blocks] int
    block_size: int,
    num_tokens: int,  # the padded row count, at least sum(num_plain + counts), known on the host: no read-back
    iota: torch.Tensor | None = None,  # arange of at least num_tokens on counts' device, where the caller keeps one
) -> FlatLayout:
    """The flattened verify batch built on the counts' device with fixed shapes (a CUDA graph can capture it): request r
    feeds positions num_computed[r] .. + num_plain[r] + counts[r] - 1; rows past the last request's are padding."""
    dev = counts.device
    num_reqs = counts.numel()
    lengths = (num_plain + counts).to(torch.int64)
    query_start = torch.zeros(num_reqs + 1, dtype=torch.int64, device=dev)
    query_start[1:] = torch.cumsum(lengths, 0)
    if iota is not None:  # a slice past the end would be short, silently
        assert iota.numel() >= num_tokens, (iota.numel(), num_tokens)
    row = torch.arange(num_tokens, device=dev) if iota is None else iota[:num_tokens]
    owner = torch.searchsorted(query_start[1:], row, right=True).clamp_(max=num_reqs - 1)
    offset = row - query_start[owner]
    real = row < query_start[-1]
    positions = torch.where(real, num_computed.to(torch.int64)[owner] + offset, 0)
    column = (positions // block_size).clamp_(max=block_tables.shape[1] - 1)
    blocks = block_tables.to(torch.int64)[owner, column]
    slots = torch.where(real, blocks * block_size + positions % block_size, -1)
    seq_lens = torch.where(lengths > 0, num_computed.to(torch.int64) + lengths, 0)
    return FlatLayout(query_start.to(torch.int32), positions, slots, owner, offset, seq_lens.to(torch.int32), real)


def drafting_verdict(
    survival: torch.Tensor,  # [R, K] host, stale (or last known) survivals of the requests about to draft
    num_other_tokens: int,  # T of the step the drafts would be verified in
    cost: CostModel,
    margin: float = 0.05,
) -> Verdict:
    """Whether drafting for these requests is worth its cost at all: the best budget's tokens per millisecond, drafting
    paid, against no speculation (no drafter pass, no drafts), with both predictions. At high load the drafter's own
    pass can cost more than the few drafts worth verifying return; then the engine does not draft (and so never falls
    below no speculation). The decision reads only stale survivals and the load, never a live draft, so it keeps
    verification lossless. Drafting stops only when no speculation is better by more than `margin`: with few requests
    the stale survivals are one noisy block each, and a wrong stop loses a whole step's drafts."""
    num_reqs = survival.shape[0]
    if num_reqs == 0:
        return Verdict(False)
    budget = choose_budget(survival, num_reqs, num_other_tokens, cost)
    gain = num_reqs + float(torch.sort(survival.flatten().double(), descending=True).values[:budget].sum())
    spec_ms = float(cost.step_ms(num_reqs, num_other_tokens + budget))
    plain_ms = float(cost.plain_step_ms(num_reqs, num_other_tokens))
    rate = {True: gain / spec_ms, False: num_reqs / plain_ms}
    return Verdict(rate[True] * (1.0 + margin) > rate[False], rate, {True: spec_ms, False: plain_ms})


def initial_prior(k: int) -> torch.Tensor:
    """[K] float64 survivals assumed for a request whose own are not known yet, before any block is seen:
    0.5 ** (j + 1) at position j (0-based)."""
    return 0.5 ** torch.arange(1, k + 1, dtype=torch.float64)


def update_prior(prior: torch.Tensor, survivals: torch.Tensor) -> torch.Tensor:
    """The prior [K] after one step's blocks: 0.9 * prior + 0.1 * the mean row of `survivals` [R, K] (the live
    survivals of the requests that held a draft); with no rows, the prior unchanged."""
    if survivals.shape[0] == 0:
        return prior
    return 0.9 * prior + 0.1 * survivals.double().mean(dim=0)
