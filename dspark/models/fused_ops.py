"""Fused Triton kernels of the decoder's small element-wise ops, with thin launchers; twins of the torch code in
models/llama.py, whose CUDA path uses them.

A decode step of a small model is launch-bound: the torch formulas cost ~7 kernels per RMSNorm, ~6 per rotary
tensor and 4 per SiLU. Here each is one kernel:

- `rms_norm` / `add_rms_norm`: the residual add and the next norm in one pass over the row;
- `rotary_qk`: RoPE of q and k (with Qwen3's per-head q/k norms first) in one launch, in place;
- `silu_mul`: SiLU of the gate times the up projection, reading the merged gate_up GEMM output.

Dtype semantics are the torch code's, rounding to the input dtype at the same points (so fp32 agrees to reduction
order and bf16 within one rounding), not its bits. Every kernel works row by row with a reduction order fixed by
the row length, so a row's result does not depend on the batch around it (utils/numerics.py). The launchers are
graph-safe: grids and outputs follow from shapes only, no host reads.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import SimpleNamespace

import torch

from dspark.utils.platform import triton_available

_forced: bool | None = None


def enabled(x: torch.Tensor) -> bool:
    """Whether the model takes the fused path for this activation: on CUDA with Triton, inference only (the kernels
    have no backward; training and the CPU path run the torch formulas)."""
    if _forced is not None:
        return _forced
    return x.is_cuda and not torch.is_grad_enabled() and triton_available()


@contextlib.contextmanager
def forced(on: bool) -> Iterator[None]:
    """Take (True) or avoid (False) the fused path whatever the device: tests compare the two paths, and run the
    kernels on CPU under the Triton interpreter."""
    global _forced
    before, _forced = _forced, on
    try:
        yield
    finally:
        _forced = before


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(
        x_ptr,  # row r at (r // inner) * stride_xo + (r % inner) * stride_xi
        res_ptr,  # [rows, dim], row stride stride_r (HAS_RESIDUAL)
        w_ptr,  # [dim]
        out_ptr,  # [rows, dim] contiguous
        res_out_ptr,  # [rows, dim] contiguous (HAS_RESIDUAL): x + residual
        inner,
        stride_xo,
        stride_xi,
        stride_r,
        dim,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        x = tl.load(x_ptr + (row // inner) * stride_xo + (row % inner) * stride_xi + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the sum in x's dtype
            tl.store(res_out_ptr + row * dim + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / dim + eps)
        y = (xf * rstd).to(x_ptr.dtype.element_ty)  # cast back before the weight, as RMSNorm.forward does
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * dim + cols, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask)

    @triton.jit
    def rotary_kernel(
        q_ptr,  # [tokens, NUM_Q_HEADS, 2 * HALF], head_dim contiguous
        k_ptr,  # [tokens, NUM_K_HEADS, 2 * HALF] (NUM_K_HEADS may be 0: q only)
        q_out_ptr,  # may be q_ptr (in place)
        k_out_ptr,
        cos_ptr,  # [tokens, 2 * HALF]
        sin_ptr,
        q_w_ptr,  # [2 * HALF] (HAS_NORM)
        k_w_ptr,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_qot,
        stride_qoh,
        stride_kot,
        stride_koh,
        stride_cos,
        stride_sin,
        eps,
        NUM_Q_HEADS: tl.constexpr,
        NUM_K_HEADS: tl.constexpr,
        BLOCK_H: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        HAS_NORM: tl.constexpr,
    ):
        # One program per token: its q heads and k heads are the rows of one [BLOCK_H, BLOCK_HALF] tile per half.
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_HALF)
        is_q = (h < NUM_Q_HEADS)[:, None]
        hk = tl.maximum(h - NUM_Q_HEADS, 0)
        mask = (h < NUM_Q_HEADS + NUM_K_HEADS)[:, None] & (d < HALF)[None, :]
        src = tl.where(
            is_q,
            q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :],
            k_ptr + t * stride_kt + hk[:, None] * stride_kh + d[None, :],
        )
        dst = tl.where(
            is_q,
            q_out_ptr + t * stride_qot + h[:, None] * stride_qoh + d[None, :],
            k_out_ptr + t * stride_kot + hk[:, None] * stride_koh + d[None, :],
        )
        dtype = q_out_ptr.dtype.element_ty
        x_lo = tl.load(src, mask=mask, other=0.0)
        x_hi = tl.load(src + HALF, mask=mask, other=0.0)
        if HAS_NORM:
            lo, hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
            rstd = tl.rsqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)) / (2 * HALF) + eps)[:, None]
            w = tl.where(is_q, q_w_ptr + d[None, :], k_w_ptr + d[None, :])
            w_lo = tl.load(w, mask=mask, other=0.0).to(tl.float32)
            w_hi = tl.load(w + HALF, mask=mask, other=0.0).to(tl.float32)
            # RMSNorm.forward per head: normalise in fp32, cast back, times the weight in the dtype.
            x_lo = (w_lo * (lo * rstd).to(dtype).to(tl.float32)).to(dtype)
            x_hi = (w_hi * (hi * rstd).to(dtype).to(tl.float32)).to(dtype)
        lo, hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
        row = t * stride_cos + d
        cos_lo = tl.load(cos_ptr + row, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        cos_hi = tl.load(cos_ptr + row + HALF, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        row = t * stride_sin + d
        sin_lo = tl.load(sin_ptr + row, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        sin_hi = tl.load(sin_ptr + row + HALF, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        # apply_rotary: x * cos + cat(-x_hi, x_lo) * sin, in fp32, cast back.
        tl.store(dst, (lo * cos_lo + (-hi) * sin_lo).to(dtype), mask=mask)
        tl.store(dst + HALF, (hi * cos_hi + lo * sin_hi).to(dtype), mask=mask)

    @triton.jit
    def silu_mul_kernel(
        gate_ptr,  # [rows, width], row stride stride_g
        up_ptr,  # [rows, width], row stride stride_u
        out_ptr,  # [rows, width] contiguous
        stride_g,
        stride_u,
        width,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        dtype = out_ptr.dtype.element_ty
        g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        # MLP.forward's gate / (1 + exp(-gate)) * up, each op rounded to the dtype as its own torch kernel is.
        e = tl.exp(-g).to(dtype).to(tl.float32)
        s = (g / (1.0 + e).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (s * u).to(dtype), mask=mask)

    return SimpleNamespace(rms_norm=rms_norm_kernel, rotary=rotary_kernel, silu_mul=silu_mul_kernel)


def _num_warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _launch_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dim = x.shape[-1]
    assert weight.shape == (dim,) and weight.stride(0) == 1, f"weight {tuple(weight.shape)}, want ({dim},)"
    assert x.stride(-1) == 1, "x needs a contiguous last dimension"
    if x.dim() == 2:
        inner, stride_xo, stride_xi = 1, x.stride(0), 0
    elif x.dim() == 3:  # per-head norms: [tokens, heads, head_dim], possibly a strided view of a merged GEMM
        inner, stride_xo, stride_xi = x.shape[1], x.stride(0), x.stride(1)
    else:
        raise ValueError(f"rms_norm takes [rows, dim] or [tokens, heads, dim], got {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = None
    if residual is not None:
        assert x.dim() == 2 and residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}"
        assert residual.dtype == x.dtype and residual.stride(1) == 1, "residual: x's dtype, contiguous rows"
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    rows = x.numel() // dim
    if rows == 0:
        return out, res_out
    block = _next_power_of_2(dim)
    _kernels().rms_norm[(rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        res_out if res_out is not None else out,
        inner,
        stride_xo,
        stride_xi,
        residual.stride(0) if residual is not None else 0,
        dim,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return out, res_out


def rms_norm(
    x: torch.Tensor,  # [rows, dim] or [tokens, heads, dim]
    weight: torch.Tensor,  # [dim]
    eps: float,
) -> torch.Tensor:  # x's shape, contiguous, dtype promote(weight, x) as RMSNorm.forward
    return _launch_norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor,  # [rows, dim]: a sublayer's output
    residual: torch.Tensor,  # [rows, dim]: the residual stream, x's dtype
    weight: torch.Tensor,  # [dim]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # rms_norm(x + residual), x + residual (new tensors, inputs untouched)
    normed, new_residual = _launch_norm(x, residual, weight, eps)
    assert new_residual is not None
    return normed, new_residual


def _launch_rotary(
    q: torch.Tensor,
    k: torch.Tensor | None,
    q_out: torch.Tensor,
    k_out: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None,
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even"
    cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)  # [n, 1, D] views -> [n, D]
    for name, t in (("cos", cos), ("sin", sin)):
        assert t.shape == (num_tokens, head_dim) and t.stride(1) == 1, f"{name} {tuple(t.shape)}, want [n, 1, D]"
    tensors = [q, q_out] + ([k, k_out] if k is not None else [])
    for t in tensors:
        assert t is not None and t.shape[0] == num_tokens and t.shape[2] == head_dim and t.stride(2) == 1, (
            f"{tuple(t.shape)}: want [{num_tokens}, heads, {head_dim}] with a contiguous head_dim"
        )
    if norm is not None:
        for w in norm[:2]:
            assert w.shape == (head_dim,) and w.dtype == q.dtype, f"norm weight {tuple(w.shape)} {w.dtype}"
    if num_tokens == 0:
        return
    num_k_heads = k.shape[1] if k is not None else 0
    k, k_out = (k, k_out) if k is not None else (q, q_out)
    half = head_dim // 2
    block_h, block_half = _next_power_of_2(num_q_heads + num_k_heads), _next_power_of_2(half)
    _kernels().rotary[(num_tokens,)](
        q,
        k,
        q_out,
        k_out,
        cos,
        sin,
        norm[0] if norm is not None else cos,
        norm[1] if norm is not None else cos,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos.stride(0),
        sin.stride(0),
        norm[2] if norm is not None else 0.0,
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        BLOCK_H=block_h,
        HALF=half,
        BLOCK_HALF=block_half,
        HAS_NORM=norm is not None,
        num_warps=_num_warps(block_h * block_half * 2),
    )


def rotary_qk(
    q: torch.Tensor,  # [n, num_heads, head_dim], head_dim contiguous (a view of a merged qkv GEMM is fine)
    k: torch.Tensor,  # [n, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [n, 1, head_dim] as Rotary.forward gives
    sin: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # Qwen3: (q_norm weight, k_norm weight, eps)
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary of q and k (after their per-head RMSNorms, if `norm`) in one launch, IN PLACE: q and k are
    overwritten and returned: in place, so the rotated q and k stay where the merged GEMM put them, beside v,
    with no allocation and no copy."""
    assert k.dtype == q.dtype, f"q {q.dtype}, k {k.dtype}"
    _launch_rotary(q, k, q, k, cos, sin, norm)
    return q, k


def rotary_k(
    k: torch.Tensor,  # [n, heads, head_dim], head_dim contiguous (a strided view of a merged GEMM is fine)
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm: tuple[torch.Tensor, float] | None = None,  # (the per-head RMSNorm weight, eps)
) -> torch.Tensor:
    """apply_rotary of one tensor (after its per-head RMSNorm, if `norm`), IN PLACE, in one launch."""
    _launch_rotary(k, None, k, None, cos, sin, None if norm is None else (norm[0], norm[0], norm[1]))
    return k


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary of one [n, heads, head_dim] tensor into a new one (x untouched)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rotary(x, None, out, None, cos, sin, None)
    return out


def silu_mul(
    gate_up: torch.Tensor,  # [n, 2 * I]: the merged GEMM's output, gate first; or the gate [n, I] when `up` is given
    up: torch.Tensor | None = None,  # [n, I]
) -> torch.Tensor:  # [n, I] contiguous, gate_up's dtype
    if up is None:
        width = gate_up.shape[-1] // 2
        assert gate_up.dim() == 2 and gate_up.shape[1] == 2 * width, f"gate_up {tuple(gate_up.shape)}: want [n, 2I]"
        gate, up = gate_up[:, :width], gate_up[:, width:]
    else:
        gate, width = gate_up, gate_up.shape[-1]
        assert gate.dim() == 2 and up.shape == gate.shape, f"gate {tuple(gate.shape)}, up {tuple(up.shape)}"
    assert up.dtype == gate.dtype and gate.stride(1) == 1 and up.stride(1) == 1, "contiguous rows of one dtype"
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.shape[0] == 0:
        return out
    block = min(1024, _next_power_of_2(width))
    _kernels().silu_mul[(gate.shape[0], -(-width // block))](
        gate, up, out, gate.stride(0), up.stride(0), width, BLOCK=block, num_warps=_num_warps(block)
    )
    return out
