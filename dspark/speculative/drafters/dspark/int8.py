"""int8 storage for drafter weights: symmetric, one scale per output row, dequantized once at load.

A checkpoint may store any 2-D weight `W` [rows, cols] as int8 `W` beside a floating-point `W_scale` [rows]; the
weight is `W * W_scale[:, None]`. Storage halves against bf16, which is what lets a deeper drafter fit the size the
repository allows. The engine computes with the dequantized weights in its own dtype, so a step costs what it did.
"""

from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale"
# Smaller tensors (norms, the confidence head's one row) stay floating point: their bytes do not matter.
MIN_ELEMENTS = 4096
# A narrow row (a low-rank Markov factor) would spend as many bytes on its fp32 scale as int8 saves.
MIN_COLUMNS = 16
QMAX = 127


def quantizable(name: str, t: torch.Tensor) -> bool:
    wide = t.dim() == 2 and t.shape[1] >= MIN_COLUMNS and t.numel() >= MIN_ELEMENTS
    return t.is_floating_point() and wide and not name.endswith(SCALE_SUFFIX)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [rows, cols] and fp32 scales [rows] with w ~= q * scale[:, None] (round to nearest, |q| <= 127)."""
    w32 = w.detach().float()
    scale = w32.abs().amax(dim=1) / QMAX
    # A row of zeros keeps scale 0 and quantizes to zeros (0 / tiny), not NaN.
    q = w32 / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    return q.round().clamp(-QMAX, QMAX).to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def quantize_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with every quantizable weight stored as int8 plus its scales; other tensors unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if quantizable(name, t):
            out[name], out[name + SCALE_SUFFIX] = quantize(t)
        else:
            out[name] = t
    return out


class ScaleError(ValueError):
    """An int8 weight that cannot be dequantized; `name` is the tensor at fault."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(problem)
        self.name = name


def dequantize_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of a state dict with each int8 weight and its scales replaced by the fp32 weight they store (a float
    state dict comes back as it was). Raises ScaleError for scales that cannot apply or int8 without scales."""
    out = dict(tensors)
    for name in [n for n in out if n.endswith(SCALE_SUFFIX)]:
        base = name[: -len(SCALE_SUFFIX)]
        problem = scale_problem(name, out.get(base), out[name])
        if problem:
            raise ScaleError(name, problem)
        out[base] = dequantize(out[base], out.pop(name), torch.float32)
    for name, t in out.items():
        if t.dtype == torch.int8:
            raise ScaleError(
                name, f"tensor {name!r} is int8 without {name + SCALE_SUFFIX!r}; int8 weights need one scale per row"
            )
    return out


def scale_problem(name: str, weight: torch.Tensor | None, scale: torch.Tensor) -> str | None:
    """Why `scale` cannot dequantize the tensor `name` (None when it can)."""
    base = name[: -len(SCALE_SUFFIX)]
    if weight is None:
        return f"tensor {name!r} scales {base!r}, which no file holds"
    if weight.dtype != torch.int8:
        return f"tensor {name!r} scales {base!r}, which has dtype {weight.dtype}; scales go with int8 weights"
    if weight.dim() != 2 or tuple(scale.shape) != (weight.shape[0],):
        return f"tensor {name!r} has shape {tuple(scale.shape)}; {base!r} {tuple(weight.shape)} needs one per row"
    if not scale.is_floating_point():
        return f"tensor {name!r} has dtype {scale.dtype}; scales are floating point"
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        return f"tensor {name!r} holds a negative or non-finite scale; scales are finite and >= 0"
    return None
