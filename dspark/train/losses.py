"""The DSpark drafter's training losses (docs/drafter.md), per block of K drafts:

- CE: cross-entropy of the draft distribution against the token the target actually produced there (weight 0.1);
- L1: ||p_draft - p_target||_1 over the full vocabulary, fp32, temperature 1 (weight 0.9): the quantity that sets
  the acceptance rate of rejection sampling (accept probability = 1 - 0.5 * ||p_d - p_t||_1);
- BCE: the confidence head against c* = 1 - 0.5 * ||p_d - p_t||_1 (detached: the confidence learns to predict
  acceptance, it does not pull the draft) (weight 1.0);
each weighted by position, exp(-k / 4) for k = 0..K-1 (early drafts matter most: a late one counts only if every
earlier one survived), and averaged over the positions that hold a real label.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

CE_WEIGHT, L1_WEIGHT, BCE_WEIGHT = 0.1, 0.9, 1.0
POSITION_DECAY = 4.0


@dataclass
class Losses:
    total: torch.Tensor  # scalar, differentiable
    ce: float
    l1: float
    bce: float
    acceptance: float  # mean of 1 - 0.5 * ||p_d - p_t||_1 over labelled positions: the expected per-draft acceptance


def position_weights(k: int, device: torch.device | None = None) -> torch.Tensor:
    return torch.exp(-torch.arange(k, dtype=torch.float32, device=device) / POSITION_DECAY)


def dspark_losses(
    draft_logits: torch.Tensor,  # [N, K, V] the drafter's corrected logits (lm_head + Markov term)
    target_logits: torch.Tensor,  # [N, K, V] the target's logits at the same positions
    labels: torch.Tensor,  # [N, K] int64: the token the target produced at each position
    mask: torch.Tensor,  # [N, K] bool: positions with a real label (inside the sequence and the loss mask)
    confidence_logits: torch.Tensor | None = None,  # [N, K] the confidence head's logits, if it has one
) -> Losses:
    n, k, v = draft_logits.shape
    if target_logits.shape != draft_logits.shape or labels.shape != (n, k) or mask.shape != (n, k):
        raise ValueError(
            f"shapes disagree: draft {tuple(draft_logits.shape)}, target {tuple(target_logits.shape)}, "
            f"labels {tuple(labels.shape)}, mask {tuple(mask.shape)}"
        )
    weights = position_weights(k, draft_logits.device)[None, :] * mask.float()  # [N, K]
    denom = weights.sum().clamp(min=1e-6)
    log_pd = F.log_softmax(draft_logits.float(), dim=-1)
    p_d = log_pd.exp()
    p_t = F.softmax(target_logits.float(), dim=-1).detach()
    ce = -log_pd.gather(-1, labels.clamp(0, v - 1)[..., None]).squeeze(-1)  # [N, K]
    l1 = (p_d - p_t).abs().sum(dim=-1)  # [N, K], in [0, 2]
    total = (CE_WEIGHT * ce * weights).sum() / denom + (L1_WEIGHT * l1 * weights).sum() / denom
    acceptance = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    bce_value = 0.0
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), acceptance, reduction="none")
        total = total + BCE_WEIGHT * (bce * weights).sum() / denom
        bce_value = float((bce.detach() * weights).sum() / denom)
    mean = lambda x: float((x.detach() * mask).sum() / mask.sum().clamp(min=1))  # noqa: E731
    return Losses(total, mean(ce), mean(l1), bce_value, mean(acceptance))
