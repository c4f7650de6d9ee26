"""The attention-backend interface: the only thing a new kernel (Triton, later) has to provide.

The model calls `ctx.backend.forward(...)` once per layer with the step's flattened q/k/v; the backend writes the new
keys and values into the paged cache and attends over it. Everything per-step lives in AttentionMetadata, built once
by the model runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """One step's batch, flattened: request r owns tokens query_start_loc[r]:query_start_loc[r+1]."""

    num_actual_tokens: int  # tokens past this are padding rows: slot -1, never attended, never written
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot per token, -1 for padding
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32 (cu_seqlens_q)
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, 0-padded
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # False: every query also sees the keys after it up to its request's seq_len (a DSpark draft block attends
    # bidirectionally within itself); True: query j sees keys up to its own position.
    causal: bool = True

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class KVCache:
    """One layer's paged cache: [num_blocks, block_size, num_kv_heads, head_dim] each."""

    key: torch.Tensor
    value: torch.Tensor


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata, num_kv_heads: int, num_heads: int, block_size: int) -> None:
        """Per-step work shared by all layers (index plans, masks); called once before the forward."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotary already applied
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


@dataclass
class AttentionContext:
    """What every attention layer needs in one step: the backend, its metadata and the per-layer caches."""

    backend: AttentionBackend
    meta: AttentionMetadata
    caches: list[KVCache]


def slots_for(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots of positions start..end-1 of a request with these blocks."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
