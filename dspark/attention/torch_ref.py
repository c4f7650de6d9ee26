"""Reference paged attention in plain torch: correct on CPU and CUDA, and batch-invariant in fp32.

Batch invariance (a request's output does not depend on its batch, its chunking or its query length) needs every
query row to see the same floating-point operations in the same order whatever else is computed beside it:

- a row's softmax uses the maximum over its visible keys (exact in any order) and sums keys in fixed tiles of TILE
  keys aligned to position 0, then adds the tiles up one by one in order; a tile that is fully masked for a row adds
  exact zeros, so padding the key range never changes a row's result;
- tiles are a batch dimension of every matmul, so a matmul's N and K never depend on the context length (BLAS may
  pick another kernel, and another summation order, for another N);
- every matmul has at least MIN_ROWS rows, because CPU BLAS switches to a differently-ordered kernel for very small M
  (see utils/numerics.py);
- short queries (decode, speculative verification) are batched across requests, long queries (prefill chunks) run
  one request at a time; both give the same bits per row.

The per-step plan (gather indices, masks, output rows) is built once in prepare() and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.attention.base import AttentionMetadata, KVCache

TILE = 64  # keys per partial sum; fixed, aligned to position 0
SHORT_QUERY = 8  # queries at most this long are batched across requests
MIN_ROWS = 4


@dataclass
class _Group:
    """Requests attended together: queries padded to q_pad each, keys padded to whole tiles."""

    q_pad: int
    num_tiles: int
    query_rows: torch.Tensor  # [G, q_pad] token index of each (padded) query
    key_slots: torch.Tensor  # [G, num_tiles * TILE] flat cache slot of each key (padding: slot 0, masked)
    mask_bias: torch.Tensor  # [G, 1, num_tiles, rows, TILE] 0 where visible, -inf elsewhere
    out_dst: torch.Tensor  # [n] token indices written
    out_src: torch.Tensor  # [n] flat (g * q_pad + j) rows they come from


class TorchAttention:
    name = "torch"

    def __init__(self) -> None:
        self._groups: list[_Group] = []
        self._meta: AttentionMetadata | None = None

    def prepare(self, meta: AttentionMetadata, num_kv_heads: int, num_heads: int, block_size: int) -> None:
        """Build this step's plan; called once per step by the model runner, before the forward."""
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        q_lens = [starts[r + 1] - starts[r] for r in range(meta.num_reqs)]
        short = [r for r in range(meta.num_reqs) if q_lens[r] <= SHORT_QUERY]
        groups = [short] if short else []
        groups += [[r] for r in range(meta.num_reqs) if q_lens[r] > SHORT_QUERY]
        group_size = num_heads // num_kv_heads
        tables = meta.block_tables.long()
        self._groups = [
            self._plan(meta, reqs, max(q_lens[r] for r in reqs), group_size, block_size, tables, starts, lens)
            for reqs in groups
        ]
        self._meta = meta

    def _plan(
        self,
        meta: AttentionMetadata,
        reqs: list[int],
        q_pad: int,
        group_size: int,
        block_size: int,
        tables: torch.Tensor,
        starts: list[int],
        lens: list[int],
    ) -> _Group:
        device = meta.slot_mapping.device
        num_tiles = -(-max(lens[r] for r in reqs) // TILE)
        rows, q_pos, dst, src = [], [], [], []
        for g, r in enumerate(reqs):
            n_q = starts[r + 1] - starts[r]
            rows.append(list(range(starts[r], starts[r + 1])) + [starts[r]] * (q_pad - n_q))
            last = range(lens[r] - n_q, lens[r]) if meta.causal else [lens[r] - 1] * n_q
            q_pos.append(list(last) + [0] * (q_pad - n_q))
            dst += range(starts[r], starts[r + 1])
            src += range(g * q_pad, g * q_pad + n_q)
        qpos = torch.tensor(q_pos, device=device)  # [G, q_pad]; padding rows sit at position 0
        # Rows of one matmul are (head in kv group, query); pad them up to MIN_ROWS at position 0.
        qpos_rows = qpos[:, None, :].expand(len(reqs), group_size, q_pad).reshape(len(reqs), group_size * q_pad)
        extra = max(0, MIN_ROWS - group_size * q_pad)
        qpos_rows = torch.cat([qpos_rows, qpos_rows.new_zeros(len(reqs), extra)], dim=1)
        kpos = torch.arange(num_tiles * TILE, device=device)
        visible = kpos[None, None, :] <= qpos_rows[:, :, None]  # [G, rows, keys]
        mask_bias = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
        mask_bias = mask_bias.view(len(reqs), -1, num_tiles, TILE).transpose(1, 2)[:, None]
        blocks = tables[reqs][:, : -(-num_tiles * TILE // block_size)]
        if blocks.shape[1] * block_size < num_tiles * TILE:  # pad with block 0: finite values, always masked
            missing = -(-num_tiles * TILE // block_size) - blocks.shape[1]
            blocks = torch.cat([blocks, blocks.new_zeros(len(reqs), missing)], dim=1)
        slots = (blocks[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)
        return _Group(
            q_pad=q_pad,
            num_tiles=num_tiles,
            query_rows=torch.tensor(rows, device=device),
            key_slots=slots[:, : num_tiles * TILE],
            mask_bias=mask_bias,
            out_dst=torch.tensor(dst, device=device),
            out_src=torch.tensor(src, device=device),
        )

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        assert meta is self._meta, "prepare() must be called with this step's metadata"
        n = meta.num_actual_tokens
        write_kv(cache, k[:n], v[:n], meta.slot_mapping[:n])
        out = torch.zeros_like(q)
        for group in self._groups:
            _attend(q, out, cache, group, scale)
        return out


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter this step's keys and values into their cache slots (all slots here are valid)."""
    num_kv_heads, head_dim = cache.key.shape[2:]
    cache.key.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(cache.key.dtype))
    cache.value.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(cache.value.dtype))


def _attend(q: torch.Tensor, out: torch.Tensor, cache: KVCache, group: _Group, scale: float) -> None:
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = cache.key.shape[2]
    size = num_heads // num_kv_heads
    num_reqs, q_pad = group.query_rows.shape
    rows = group.mask_bias.shape[3]

    # [G, Hkv, rows, D]: heads sharing a kv head become rows of one matmul (GQA without copying keys).
    qg = q[group.query_rows].float().view(num_reqs, q_pad, num_kv_heads, size, head_dim)
    qg = qg.permute(0, 2, 3, 1, 4).reshape(num_reqs, num_kv_heads, size * q_pad, head_dim)
    if rows > size * q_pad:
        qg = torch.cat([qg, qg.new_zeros(num_reqs, num_kv_heads, rows - size * q_pad, head_dim)], dim=2)
    keys = cache.key.view(-1, num_kv_heads, head_dim)[group.key_slots].float().transpose(1, 2)  # [G, Hkv, L, D]
    values = cache.value.view(-1, num_kv_heads, head_dim)[group.key_slots].float().transpose(1, 2)

    # Tiles are a batch dimension, so every matmul has the same N (TILE or D) and K (D or TILE) whatever the context
    # length; only M (rows) varies, and it is at least MIN_ROWS.
    tiles = group.num_tiles
    k_tiles = keys.reshape(num_reqs, num_kv_heads, tiles, TILE, head_dim)
    v_tiles = values.reshape(num_reqs, num_kv_heads, tiles, TILE, head_dim)
    s = torch.matmul(qg[:, :, None], k_tiles.transpose(-1, -2)) * scale + group.mask_bias  # [G, Hkv, tiles, rows, TILE]
    m = s.amax(dim=(2, 4), keepdim=True)  # exact in any order; every row sees key 0, so m is finite
    p = torch.exp(s - m)
    denom_tiles = p.sum(-1)  # [G, Hkv, tiles, rows]: fixed-length sums
    acc_tiles = torch.matmul(p, v_tiles)  # [G, Hkv, tiles, rows, D]
    denom, acc = denom_tiles[:, :, 0], acc_tiles[:, :, 0]
    for t in range(1, tiles):  # NOTE: in order, one tile at a time: the sum's order never depends on the padding
        denom = denom + denom_tiles[:, :, t]
        acc = acc + acc_tiles[:, :, t]
    res = (acc / denom[..., None])[:, :, : size * q_pad]  # [G, Hkv, size*q_pad, D]
    res = res.view(num_reqs, num_kv_heads, size, q_pad, head_dim).permute(0, 3, 1, 2, 4)
    res = res.reshape(num_reqs * q_pad, num_heads, head_dim).to(out.dtype)
    out.index_copy_(0, group.out_dst, res[group.out_src])
