"""One training step of the DSpark drafter, and its optimiser (DESIGN.md section 6).

Per target-generated sequence: the frozen target runs once (its tapped layers feed the drafter, its logits at the
block positions are what the drafter learns), anchors are sampled in the response, the blocks run packed
(train/forward.py), and the three losses are taken (train/losses.py). AdamW without weight decay, 4% linear warm-up
then cosine decay, gradients clipped at 1.0.
"""

from __future__ import annotations

import math

import torch

from dspark.models.llama import CausalLM
from dspark.spec.dspark.model import DSparkModel
from dspark.train.anchors import sample_blocks
from dspark.train.forward import block_states, draft_outputs, target_pass
from dspark.train.losses import Losses, dspark_losses

LEARNING_RATE = 6e-4
WARMUP_FRACTION = 0.04
CLIP_NORM = 1.0


def sequence_loss(
    model: DSparkModel,
    target: CausalLM,
    tokens: torch.Tensor,  # [S] prompt + the target's own response
    loss_mask: torch.Tensor,  # [S] bool: the response
    num_blocks: int,
    generator: torch.Generator,
) -> Losses | None:
    """The losses of up to num_blocks blocks of one sequence; None when it has no valid anchor."""
    k = model.config.block_size
    blocks = sample_blocks(tokens.cpu(), loss_mask.cpu(), k, num_blocks, generator)
    if blocks.anchors.numel() == 0:
        return None
    dev = tokens.device
    anchors, labels, mask = blocks.anchors.to(dev), blocks.labels.to(dev), blocks.mask.to(dev)
    out = target_pass(target, tokens, model.config.target_layer_ids)
    positions = (anchors[:, None] + torch.arange(k, device=dev)[None, :]).clamp(max=tokens.numel() - 1)
    with torch.no_grad():
        target_logits = target.compute_logits(out.hidden[positions.flatten()]).view(*positions.shape, -1).float()
    states = block_states(model, target.model.embed_tokens, tokens, model.context_features(out.taps), anchors)
    previous = torch.cat([tokens[anchors][:, None], labels[:, :-1]], dim=1)  # teacher forcing
    draft_logits, conf_logits = draft_outputs(model, target, states, previous)
    return dspark_losses(draft_logits, target_logits, labels, mask, conf_logits)


def make_optimizer(
    model: DSparkModel, total_steps: int, lr: float = LEARNING_RATE
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, round(WARMUP_FRACTION * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def optimiser_step(
    model: DSparkModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    loss: torch.Tensor,
) -> float:
    """Backward, clip, step; returns the gradient norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP_NORM)
    optimizer.step()
    scheduler.step()
    return float(norm)
