"""A deeper drafter from a trained one: new layers on top, each starting as the identity.

A new layer's attention and MLP output projections start at zero, so its residual adds exactly nothing and the grown
drafter drafts what its source drafts, bit for bit, until training moves them (their gradients are not zero: each
projection's input is not). Fine-tuning therefore starts from the source's quality, where a deeper drafter trained
from scratch would first have to relearn it. Whether the extra layers then pay is a GPU training experiment, not run.
"""

from __future__ import annotations

import dataclasses

import torch

from dspark.speculative.drafters.dspark.checkpoint import random_drafter
from dspark.speculative.drafters.dspark.model import DSparkModel


def grow(model: DSparkModel, num_new: int, seed: int = 0) -> DSparkModel:
    """`model` with num_new identity layers added after its own (fp32, on model's device)."""
    if num_new < 1:
        raise ValueError(f"num_new={num_new}: a drafter grows by at least one layer")
    old = model.config.num_layers
    cfg = dataclasses.replace(model.config, num_layers=old + num_new)
    weight = next(model.parameters())
    grown = random_drafter(cfg, seed).to(device=weight.device, dtype=weight.dtype)
    result = grown.load_state_dict(model.state_dict(), strict=False)
    new = {n for n, _ in grown.named_parameters() if n.startswith("layers.") and int(n.split(".")[1]) >= old}
    assert not result.unexpected_keys and set(result.missing_keys) == new, result
    with torch.no_grad():
        for layer in grown.layers[old:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    grown.rotary = model.rotary  # the source's tables (load_drafter sizes them for the target)
    return grown.train(model.training)
