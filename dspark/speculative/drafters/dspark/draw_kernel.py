"""One drafted position's sampling in one Triton kernel: the Markov correction added, the temperature softmax written,
the draft drawn at its uniform. The torch twin is markov.py's loop body (temperature_probs, then inverse_cdf_rows).

Counted as CUDA runs it (`benchmarks/spec_step_ops.py`, on CPU), that body is about 22 kernels a position at T = 1
(the add, argmax, division, softmax, the fp64 cast and scan, the draw's guard), mostly vocabulary-wide: 1,977 of a
fixed-7 step's 3,283 MB at 64 requests, and 25 launches a position at one request. Here one program per request reads
the base logits and the correction four times (max and argmax, the softmax's sum, the distribution written with its
fp64 total, the fp64 scan that finds the draw) and writes the distribution once.

It computes what the twin computes, rounded differently: the softmax's sum and the scan run in another order, so the
distribution can differ from torch's in the last bits, and a draw from it only where its uniform falls within fp64
rounding of a step of the CDF. The draft is drawn from exactly the distribution the kernel writes, and verification
reads that one, so sampling stays lossless as with the twin: the tokens are distributed as the target's. Every draw of
a device goes one way: on CUDA every sampled draft position (synchronous and pipelined steps, captured or eager) draws
here, elsewhere through the twin.
"""

from __future__ import annotations

import functools
import os

import torch

BLOCK = 2048  # vocabulary entries a program holds at once (49,152 = 24 blocks)


def enabled(device: torch.device) -> bool:
    """Whether drafted positions draw through the kernel on this device: CUDA with Triton, unless DSPARK_FUSED_DRAW=0
    (the twin, for comparison)."""
    if device.type != "cuda" or os.environ.get("DSPARK_FUSED_DRAW", "1") == "0":
        return False
    from dspark.utils.platform import triton_available

    return triton_available()


@functools.cache
def _kernel():  # a Triton JIT function (untyped)
    # NOTE: module globals, not locals: Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) swaps the language's
    # functions in the kernel's globals and looks up what the kernel calls there; a local `tl` or helper fails there.
    global triton, tl, load_logits
    import triton
    import triton.language as tl

    @triton.jit
    def load_logits(base_row, corr_row, offs, inside, HAS_CORR: tl.constexpr):
        """A block of one row's drafted logits: base plus the Markov correction; -inf past the vocabulary."""
        logit = tl.load(base_row + offs, mask=inside, other=float("-inf"))
        if HAS_CORR:
            logit += tl.load(corr_row + offs, mask=inside, other=0.0)
        return logit

    @triton.jit
    def draw_kernel(
        base_ptr,  # [R, V] fp32 rows (a position's slice of the block's logits)
        base_stride,
        corr_ptr,  # [R, V] fp32 rows: the Markov correction (read only with HAS_CORR)
        corr_stride,
        temp_ptr,  # [R] fp32: softmax_temperatures()
        greedy_ptr,  # [R] bool
        u_ptr,  # [R] fp64, in [0, 1)
        u_stride,
        q_ptr,  # [R, V] fp32 out, contiguous rows
        x_ptr,  # [R] int64 out
        V,
        HAS_CORR: tl.constexpr,
        ONE_HOT_GREEDY: tl.constexpr,  # greedy rows' distribution is one-hot at the argmax, else their softmax
        BLOCK: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, BLOCK)
        base_row = base_ptr + r * base_stride
        corr_row = corr_ptr + r * corr_stride
        t = tl.load(temp_ptr + r)
        greedy = tl.load(greedy_ptr + r) != 0

        # 1. the logits' max and its first index (torch.argmax's tie-break)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_at = tl.full([BLOCK], 0, tl.int64)
        for start in range(0, V, BLOCK):
            offs = start + lanes
            inside = offs < V
            logit = load_logits(base_row, corr_row, offs, inside, HAS_CORR)
            better = logit > best  # strictly: a lane keeps its first index of an equal maximum
            best_at = tl.where(better, offs.to(tl.int64), best_at)
            best = tl.where(better, logit, best)
        top_logit = tl.max(best, axis=0)
        top = tl.min(tl.where(best == top_logit, best_at, V), axis=0)
        z_max = top_logit / t  # dividing by t > 0 keeps the order: the max of logit / t

        # 2. the softmax's denominator
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + lanes
            inside = offs < V
            logit = load_logits(base_row, corr_row, offs, inside, HAS_CORR)
            acc += tl.where(inside, tl.exp(logit / t - z_max), 0.0)
        denom = tl.sum(acc, axis=0)

        # 3. the distribution, written, and its fp64 total
        one_hot = greedy & ONE_HOT_GREEDY
        total = tl.zeros([1], dtype=tl.float64)
        for start in range(0, V, BLOCK):
            offs = start + lanes
            inside = offs < V
            logit = load_logits(base_row, corr_row, offs, inside, HAS_CORR)
            q = tl.exp(logit / t - z_max) / denom
            q = tl.where(one_hot, tl.where(offs == top, 1.0, 0.0), q)
            q = tl.where(inside, q, 0.0)
            tl.store(q_ptr + r * V + offs, q, mask=inside)
            total += tl.sum(q.to(tl.float64), axis=0)

        # 4. the draw: the first token whose fp64 CDF passes u * total; where rounding leaves none, the last token of
        # positive probability (inverse_cdf_rows' guard). A zero-probability token is never drawn: a block's first
        # entry can see the carry pass the threshold without adding to it.
        x = top
        if not greedy:
            threshold = tl.load(u_ptr + r * u_stride) * tl.sum(total, axis=0)
            carry = tl.zeros([1], dtype=tl.float64)
            found = V
            last_positive = -1
            for start in range(0, V, BLOCK):
                offs = start + lanes
                inside = offs < V
                logit = load_logits(base_row, corr_row, offs, inside, HAS_CORR)
                q = tl.where(inside, tl.exp(logit / t - z_max) / denom, 0.0).to(tl.float64)
                cdf = tl.cumsum(q, axis=0) + tl.sum(carry, axis=0)
                hit = (cdf > threshold) & (q > 0)
                found = tl.minimum(found, tl.min(tl.where(hit, offs, V), axis=0))
                last_positive = tl.maximum(last_positive, tl.max(tl.where(q > 0, offs, -1), axis=0))
                carry += tl.sum(q, axis=0)
            x = tl.where(found < V, found, last_positive).to(tl.int64)
        tl.store(x_ptr + r, x)

    return draw_kernel


def draw_position(
    base: torch.Tensor,  # [R, V] fp32, rows may be strided (base_logits[:, j])
    correction: torch.Tensor | None,  # [R, V] fp32 rows: the Markov head's W2 W1[x], or None
    temps: torch.Tensor,  # [R] fp32, softmax_temperatures()
    greedy: torch.Tensor,  # [R] bool
    u: torch.Tensor,  # [R] fp64 (may be a strided column of [R, k])
    out: torch.Tensor | None = None,  # [R, V] fp32 contiguous; None: a new tensor
    one_hot_greedy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts [R] int64, distributions [R, V] fp32): each row's softmax(logits / temperature), greedy rows one-hot at
    the argmax (or their softmax, one_hot_greedy False), and the draft drawn from it at u, greedy rows' the argmax.
    Reads no host value, so a CUDA graph can capture it. Its grid is R programs."""
    num_rows, vocab = base.shape
    rows = [base] if correction is None else [base, correction]
    if any(t.dtype != torch.float32 or t.stride(1) != 1 or t.shape != base.shape for t in rows):
        raise ValueError("draw_position: logits and correction must be [R, V] fp32 with contiguous rows")
    if temps.dtype != torch.float32 or greedy.dtype != torch.bool or u.dtype != torch.float64:
        raise ValueError("draw_position: temperatures are fp32, greedy flags bool and uniforms fp64")
    q = torch.empty(num_rows, vocab, dtype=torch.float32, device=base.device) if out is None else out
    if not q.is_contiguous() or q.shape != (num_rows, vocab):
        raise ValueError(f"draw_position: out must be a contiguous [{num_rows}, {vocab}] tensor, not {tuple(q.shape)}")
    x = torch.empty(num_rows, dtype=torch.int64, device=base.device)
    if num_rows == 0:
        return x, q
    corr = base if correction is None else correction
    _kernel()[(num_rows,)](
        base,
        base.stride(0),
        corr,
        corr.stride(0),
        temps,
        greedy,
        u,
        u.stride(0),
        q,
        x,
        vocab,
        HAS_CORR=correction is not None,
        ONE_HOT_GREEDY=one_hot_greedy,
        BLOCK=BLOCK,
    )
    return x, q
