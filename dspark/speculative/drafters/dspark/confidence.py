"""The confidence head: how likely each draft is to survive verification, from what the drafter already knows."""

from __future__ import annotations

import torch
from torch import nn


class ConfidenceHead(nn.Module):
    """c_k = sigmoid((w . [h_k ; W1[x_{k-1}]] + b) / T_k): the drafter's state and the Markov embedding of the token
    before; T_k is the per-position calibration temperature (1 until calibrated)."""

    def __init__(self, hidden_size: int, markov_rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + markov_rank, 1)

    def logit(self, h: torch.Tensor, prev_embedding: torch.Tensor) -> torch.Tensor:
        """h: [n, hidden], prev_embedding: [n, rank] -> [n] fp32 logits."""
        return self.proj(torch.cat([h, prev_embedding.to(h.dtype)], dim=-1)).float().squeeze(-1)
