"""Where training blocks start: anchors in a target-generated sequence, and each block's labels.

A block anchored at position a feeds [x_a, mask x (K-1)] at positions a..a+K-1 and drafts x_{a+1}..x_{a+K}; it sees
context strictly before a. An anchor is valid when the anchor and the token after it are both in the loss mask (the
response, not the prompt), so every block's first draft is a response token; later positions past the sequence or
outside the mask are masked out of the losses (never a block without a label). Anchors are sampled without
replacement, reproducibly from a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Blocks:
    anchors: torch.Tensor  # [B] int64 positions in the sequence
    labels: torch.Tensor  # [B, K] int64: x_{a+1} .. x_{a+K} (0 where masked)
    mask: torch.Tensor  # [B, K] bool: which labels count


def valid_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """[S] bool loss mask -> positions a with loss_mask[a] and loss_mask[a + 1] (and a >= 1: some context before)."""
    m = loss_mask.bool()
    ok = torch.zeros_like(m)
    ok[:-1] = m[:-1] & m[1:]
    ok[0] = False
    return ok.nonzero().flatten()


def sample_blocks(
    tokens: torch.Tensor,  # [S] int64
    loss_mask: torch.Tensor,  # [S] bool
    block_size: int,
    num_blocks: int,
    generator: torch.Generator,
) -> Blocks:
    """Up to num_blocks anchors drawn without replacement among the valid ones, in increasing order."""
    if tokens.shape != loss_mask.shape or tokens.dim() != 1:
        raise ValueError(f"tokens {tuple(tokens.shape)} and loss_mask {tuple(loss_mask.shape)} must be one [S] each")
    valid = valid_anchors(loss_mask)
    take = min(num_blocks, valid.numel())
    anchors = valid[torch.randperm(valid.numel(), generator=generator)[:take]].sort().values
    offsets = torch.arange(1, block_size + 1)
    idx = anchors[:, None] + offsets[None, :]  # [B, K]
    inside = idx < tokens.numel()
    idx = idx.clamp(max=tokens.numel() - 1)
    mask = inside & loss_mask.bool()[idx]
    labels = torch.where(mask, tokens[idx], torch.zeros_like(idx))
    return Blocks(anchors, labels, mask)


def block_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """[B] anchors -> [B*K, context_len + B*K] bool (True = may attend), or [N, B] -> [N, B*K, context_len + B*K], for
    packing B blocks of a sequence into one pass: a block's queries see context keys before its anchor and every key
    of their own block (bidirectional), nothing else. No row is empty: a block always sees itself."""
    rows = anchors if anchors.dim() == 2 else anchors[None]
    b = rows.shape[1]
    ctx = torch.arange(context_len, device=rows.device)[None, None, :] < rows[:, :, None]  # [N, B, C]
    own = torch.eye(b, dtype=torch.bool, device=rows.device).repeat_interleave(block_size, dim=1)  # [B, B*K]
    mask = torch.cat([ctx, own.expand(rows.shape[0], b, b * block_size)], dim=2).repeat_interleave(block_size, dim=1)
    return mask if anchors.dim() == 2 else mask[0]
