"""One training step of the DSpark drafter, and its optimiser (docs/drafter.md).

Per batch of target-generated sequences: the frozen target runs once (its tapped layers feed the drafter, its logits
at the block positions are what the drafter learns), anchors are sampled in each response, the blocks run packed
(train/forward.py), and the three losses are taken over all of them (train/losses.py). AdamW without weight decay,
4% linear warm-up then cosine decay, gradients clipped at 1.0.
"""

from __future__ import annotations

import math

import torch

from dspark.models.llama import CausalLM
from dspark.speculative.drafters.dspark.model import DSparkModel
from dspark.train.anchors import sample_blocks
from dspark.train.forward import block_states, draft_outputs, target_pass
from dspark.train.losses import Losses, dspark_losses

LEARNING_RATE = 6e-4
WARMUP_FRACTION = 0.04
CLIP_NORM = 1.0


def pad_batch(sequences: list[tuple[list[int], int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, num_prompt_tokens) per sequence -> right-padded tokens [N, S] and loss mask [N, S] (the responses)."""
    s = max(len(t) for t, _ in sequences)
    tokens = torch.zeros(len(sequences), s, dtype=torch.long)
    mask = torch.zeros(len(sequences), s, dtype=torch.bool)
    for i, (t, num_prompt) in enumerate(sequences):
        tokens[i, : len(t)] = torch.tensor(t)
        mask[i, num_prompt : len(t)] = True
    return tokens.to(device), mask.to(device)


def batch_loss(
    model: DSparkModel,
    target: CausalLM,
    tokens: torch.Tensor,  # [N, S] right-padded: prompts + the target's own responses
    loss_mask: torch.Tensor,  # [N, S] bool: the responses
    num_blocks: int,
    generator: torch.Generator,
) -> Losses | None:
    """The losses of up to num_blocks blocks per sequence; None when no sequence has a valid anchor."""
    k = model.config.block_size
    n, s = tokens.shape
    cpu_tokens, cpu_mask = tokens.cpu(), loss_mask.cpu()
    per_row = [sample_blocks(cpu_tokens[i], cpu_mask[i], k, num_blocks, generator) for i in range(n)]
    b = max(bl.anchors.numel() for bl in per_row)
    if b == 0:
        return None
    # Rows with fewer blocks are padded with blocks at anchor 1 whose labels are all masked out of the losses.
    anchors = torch.ones(n, b, dtype=torch.long)
    labels = torch.zeros(n, b, k, dtype=torch.long)
    mask = torch.zeros(n, b, k, dtype=torch.bool)
    for i, bl in enumerate(per_row):
        m = bl.anchors.numel()
        anchors[i, :m], labels[i, :m], mask[i, :m] = bl.anchors, bl.labels, bl.mask
    dev = tokens.device
    anchors, labels, mask = anchors.to(dev), labels.to(dev), mask.to(dev)
    out = target_pass(target, tokens, model.config.target_layer_ids)
    positions = (anchors[:, :, None] + torch.arange(k, device=dev)).clamp(max=s - 1).view(n, b * k)
    with torch.no_grad():
        picked = out.hidden.gather(1, positions[:, :, None].expand(-1, -1, out.hidden.shape[-1]))
        target_logits = target.compute_logits(picked.flatten(0, 1)).view(n * b, k, -1).float()
    states = block_states(model, target.model.embed_tokens, tokens, model.context_features(out.taps), anchors)
    previous = torch.cat([tokens.gather(1, anchors)[:, :, None], labels[:, :, :-1]], dim=2)  # teacher forcing
    draft_logits, conf_logits = draft_outputs(model, target, states.flatten(0, 1), previous.flatten(0, 1))
    return dspark_losses(draft_logits, target_logits, labels.flatten(0, 1), mask.flatten(0, 1), conf_logits)


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
