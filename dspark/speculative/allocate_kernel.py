"""Triton kernels of adaptive verification, each with its torch twin in speculative/budget.py (identical results).

allocate: slot (r, j) is verified when fewer than `budget` valid slots beat it, where s beats t if s's survival is
larger, or equal with a smaller position-major index (j * R + r). That is the stable descending sort of the torch
twin, counted instead of sorted: one program per request compares its K slots with every slot, so the kernel needs
no host-side sizes beyond the grid (R), reads the budget from device memory, and can sit inside a CUDA graph.
R * K * R*K comparisons grow quadratically, but stay cheap for a GPU at the batch sizes served.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _allocate_kernel():
    import triton
    import triton.language as tl

    # NOTE: num_reqs changes every step; left specialisable, Triton would compile a variant for R == 1 and for R a
    # multiple of 16, each a second-long stall in the middle of serving.
    @triton.jit(do_not_specialize=["num_reqs"])
    def allocate_kernel(
        survival_ptr,  # [R, K] fp32, row-major
        caps_ptr,  # [R] int64
        budget_ptr,  # [1] int64
        counts_ptr,  # [R] int64 out
        num_reqs,
        K: tl.constexpr,
        K_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        r = tl.program_id(0)
        j = tl.arange(0, K_PAD)
        cap = tl.load(caps_ptr + r)
        mine_valid = j < cap
        mine = tl.load(survival_ptr + r * K + j, mask=j < K, other=-1.0)
        mine = tl.where(mine_valid, mine, -1.0)
        mine_idx = j * num_reqs + r  # position-major index
        beaten_by = tl.zeros([K_PAD], dtype=tl.int32)
        total = num_reqs * K
        for start in range(0, total, BLOCK):
            p = start + tl.arange(0, BLOCK)  # position-major indices of the other slots
            in_range = p < total
            other_r = p % num_reqs
            other_j = p // num_reqs
            other_cap = tl.load(caps_ptr + other_r, mask=in_range, other=0)
            other_valid = in_range & (other_j < other_cap)
            other = tl.load(survival_ptr + other_r * K + other_j, mask=other_valid, other=-1.0)
            beats = (other[None, :] > mine[:, None]) | (
                (other[None, :] == mine[:, None]) & (p[None, :] < mine_idx[:, None])
            )
            beats = beats & other_valid[None, :]
            beaten_by += tl.sum(beats.to(tl.int32), axis=1)
        budget = tl.load(budget_ptr)
        chosen = mine_valid & (beaten_by.to(tl.int64) < budget)
        tl.store(counts_ptr + r, tl.sum(chosen.to(tl.int64), axis=0))

    return allocate_kernel


def allocate_triton(survival: torch.Tensor, budget: int | torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """[R, K] survivals on CUDA -> [R] int64 counts; the budget may be a device tensor (no host read)."""
    import triton

    num_reqs, k = survival.shape
    counts = torch.empty(num_reqs, dtype=torch.int64, device=survival.device)
    if num_reqs == 0:
        return counts
    budget_t = torch.as_tensor(budget, dtype=torch.int64, device=survival.device).reshape(1)
    _allocate_kernel()[(num_reqs,)](
        survival.float().contiguous(),
        caps.to(torch.int64).contiguous(),
        budget_t,
        counts,
        num_reqs,
        K=k,
        K_PAD=triton.next_power_of_2(k),
        BLOCK=256,
    )
    return counts
