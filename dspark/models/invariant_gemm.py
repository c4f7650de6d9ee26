"""A batch-invariant linear layer for CUDA: one Triton GEMM whose tiles never depend on the number of rows.

cuBLAS picks its kernel (tile shape, split-K) from M, N and K, so a row's bits depend on how many rows share the
GEMM: a token verified with 7 drafts, decoded alone, or decoded beside 255 others can get different logits, and in
bf16 an argmax near a tie can flip. That breaks "greedy output with speculation equals output without it" and "a
request's output does not depend on its batch" (docs/numerics.md).

Here every call runs one compiled kernel: fixed BLOCK_M x BLOCK_N output tiles, each program walking K in BLOCK_K steps
from 0 in order, fp32 accumulation, no split-K. Row i's result is the same dot products in the same order whatever M
is or which tile the row lands in (rows past M load zeros and are never stored). M is not specialised on, so Triton
compiles no variant for M = 1 or M % 16 == 0. The grid follows from shapes only: graph-safe.

The cost is cuBLAS's tuning: a decode step's skinny GEMMs run at a few programs per SM. Used only with
`batch_invariant=True` (EngineConfig), like vLLM's VLLM_BATCH_INVARIANT and SGLang's deterministic inference.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

# NOTE: fixed for every call: changing one changes the reduction (and the MMA instruction), hence the bits.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 3


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def matmul_kernel(
        a_ptr,  # [M, K]
        w_ptr,  # [N, K] (nn.Linear's weight)
        bias_ptr,  # [N] (HAS_BIAS)
        c_ptr,  # [M, N]
        M,
        N,
        K: tl.constexpr,  # a model has a few (hidden, intermediate sizes): one compiled variant each
        stride_am,
        stride_ak,
        stride_wn,
        stride_wk,
        stride_cm,
        stride_cn,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # rn * stride_wn passes 2**31 for big vocabularies
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            kk = i * BLOCK_K + rk
            a = tl.load(
                a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                mask=(rm[:, None] < M) & (kk[None, :] < K),
                other=0.0,
            )
            w = tl.load(
                w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                mask=(rn[None, :] < N) & (kk[:, None] < K),
                other=0.0,
            )
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:  # as cuBLAS's addmm behind F.linear: added to the fp32 accumulator, rounded once
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        out = acc.to(c_ptr.dtype.element_ty)
        dst = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(dst, out, mask=(rm[:, None] < M) & (rn[None, :] < N))

    return SimpleNamespace(matmul=matmul_kernel, cdiv=triton.cdiv)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) with the same bits for a row whatever the other rows are. x: [..., K], weight: [N, K]."""
    assert weight.dim() == 2 and x.shape[-1] == weight.shape[1], f"x {tuple(x.shape)}, weight {tuple(weight.shape)}"
    assert x.dtype == weight.dtype, f"x is {x.dtype}, the weight {weight.dtype}"
    lead = x.shape[:-1]
    a = x.reshape(-1, x.shape[-1])
    m, k = a.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    kern = _kernels()
    grid = (kern.cdiv(m, BLOCK_M), kern.cdiv(n, BLOCK_N))
    kern.matmul[grid](
        a,
        weight,
        bias if bias is not None else weight,  # never read without HAS_BIAS
        out,
        m,
        n,
        k,  # K
        a.stride(0),
        a.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        # NOTE: fp32 stays fp32 (no TF32), as the attention kernels.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out.view(*lead, n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, invariant: bool) -> torch.Tensor:
    """F.linear, or the batch-invariant GEMM where asked for, on CUDA and for inference (CPU matmuls are made
    invariant by row padding instead: utils/numerics.py; the kernel has no backward, so training through the
    target, as drafter training does, takes F.linear)."""
    if invariant and x.is_cuda and not torch.is_grad_enabled():
        return invariant_linear(x, weight, bias)
    return F.linear(x, weight, bias)
