"""Linear layers through oneDNN with pre-packed weights: the fast (not batch-invariant) CPU path.

F.linear re-lays a weight out for its kernel on every call; packing once at load lets each step stream the weight in
the kernel's own blocked layout. On the 2-vCPU reference machine the default model's GEMMs take ~35% less time this
way, in fp32 and bf16 alike (docs/numerics.md). A packed weight is an extra copy (the module keeps its parameters:
state_dict, training and the transformers comparison read them) and is stale after the module moves or is written.
"""

from __future__ import annotations

import torch


def available() -> bool:
    """Whether this torch has oneDNN's linear ops (x86 and arm64 builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] in oneDNN's layout for this CPU, or None where oneDNN cannot take it (then use F.linear)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or not available():
        return None
    try:
        with torch.no_grad():
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    except RuntimeError:  # a build without this dtype's kernels
        return None


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for the weight `packed` came from; x: [..., in], any strides."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
