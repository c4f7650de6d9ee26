"""Reference paged attention in plain torch: correct on CPU and CUDA, and batch-invariant in fp32.

Batch invariance (a request's output does not depend on its batch, its chunking or its query length) needs every
query row to see the same floating-point operations in the same order whatever else is computed beside it:

- keys are visited in fixed tiles aligned to absolute position 0 (online softmax, as flash attention does), so the
  reduction order over keys depends only on the query's own position; tiles that are fully masked for a query are
  exact no-ops for it (scale by exp(0) = 1, add 0);
- every matmul has at least MIN_ROWS rows, because CPU BLAS switches to a differently-ordered kernel for very
  small M (measured on this machine: rows differ for M <= 3, agree for every M >= 4);
- short queries (decode, speculative verification) are batched together, padded to SHORT_QUERY rows each, and long
  queries (prefill chunks) run one request at a time; both paths give the same bits per row.
"""

from __future__ import annotations

import torch

from dspark.worker.attention.base import AttentionMetadata, KVCache

TILE = 256  # keys per online-softmax tile; fixed, aligned to position 0
SHORT_QUERY = 8  # queries at most this long are batched across requests
MIN_ROWS = 8


class TorchAttention:
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        n = meta.num_actual_tokens
        write_kv(cache, k[:n], v[:n], meta.slot_mapping[:n])
        out = torch.zeros_like(q)
        starts = meta.query_start_loc_cpu
        short = [r for r in range(meta.num_reqs) if starts[r + 1] - starts[r] <= SHORT_QUERY]
        long = [r for r in range(meta.num_reqs) if starts[r + 1] - starts[r] > SHORT_QUERY]
        if short:
            _attend_group(q, out, cache, meta, short, SHORT_QUERY, scale)
        for r in long:
            _attend_group(q, out, cache, meta, [r], starts[r + 1] - starts[r], scale)
        return out


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter this step's keys and values into their cache slots (all slots here are valid)."""
    num_kv_heads, head_dim = cache.key.shape[2:]
    cache.key.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(cache.key.dtype))
    cache.value.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(cache.value.dtype))


def _attend_group(
    q: torch.Tensor,
    out: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    reqs: list[int],
    q_pad: int,
    scale: float,
) -> None:
    """Attention for requests `reqs`, each with its queries padded to q_pad rows; writes rows of `out`."""
    device = q.device
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = cache.key.shape[1:3]
    group = num_heads // num_kv_heads
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    num_tiles = -(-max(lens[r] for r in reqs) // TILE)
    blocks_per_tile = -(-TILE // block_size)
    num_blocks = num_tiles * blocks_per_tile

    # Gather queries into [G, q_pad, H, D] and their absolute positions; padding rows sit at position 0.
    rows, q_pos = [], []
    for r in reqs:
        n_q = starts[r + 1] - starts[r]
        first = lens[r] - n_q
        rows.append(list(range(starts[r], starts[r + 1])) + [starts[r]] * (q_pad - n_q))
        q_pos.append(list(range(first, lens[r])) + [0] * (q_pad - n_q))
    row_idx = torch.tensor(rows, device=device)
    qpos = torch.tensor(q_pos, device=device)  # [G, q_pad]
    qg = q[row_idx].float()  # [G, q_pad, H, D]
    # [G, Hkv, group * q_pad, D]: heads sharing a kv head become rows of one matmul (GQA without copying keys).
    qg = qg.view(len(reqs), q_pad, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(len(reqs), num_kv_heads, group * q_pad, head_dim)
    qpos_rows = qpos[:, None, :].expand(len(reqs), group, q_pad).reshape(len(reqs), 1, group * q_pad)
    pad_rows = max(0, MIN_ROWS - group * q_pad)
    if pad_rows:
        qg = torch.cat([qg, qg.new_zeros(len(reqs), num_kv_heads, pad_rows, head_dim)], dim=2)
        qpos_rows = torch.cat([qpos_rows, qpos_rows.new_zeros(len(reqs), 1, pad_rows)], dim=2)

    # Block tables padded with block 0 (always holds finite values) up to whole tiles; those keys are masked.
    table = meta.block_tables[reqs][:, : min(num_blocks, meta.block_tables.shape[1])].long()
    if table.shape[1] < num_blocks:
        table = torch.cat([table, table.new_zeros(len(reqs), num_blocks - table.shape[1])], dim=1)
    keys = cache.key[table].flatten(1, 2)[:, : num_tiles * TILE]  # [G, tiles*TILE, Hkv, D]
    values = cache.value[table].flatten(1, 2)[:, : num_tiles * TILE]

    m = torch.full(qg.shape[:3], float("-inf"), device=device)
    denom = torch.zeros(qg.shape[:3], device=device)
    acc = torch.zeros(qg.shape, device=device)
    for t in range(num_tiles):
        kt = keys[:, t * TILE : (t + 1) * TILE].float().transpose(1, 2)  # [G, Hkv, TILE, D]
        vt = values[:, t * TILE : (t + 1) * TILE].float().transpose(1, 2)
        kpos = torch.arange(t * TILE, (t + 1) * TILE, device=device)
        visible = kpos[None, None, None, :] <= qpos_rows[..., None]  # [G, 1, rows, TILE]
        s = torch.matmul(qg, kt.transpose(-1, -2)) * scale
        s = s.masked_fill(~visible, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        # NOTE: a tile fully masked for a row leaves m_new == m (finite after tile 0), so alpha == 1 and p == 0.
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        denom = denom * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.matmul(p, vt)
        m = m_new
    res = (acc / denom[..., None])[:, :, : group * q_pad]  # [G, Hkv, group*q_pad, D]
    res = res.view(len(reqs), num_kv_heads, group, q_pad, head_dim).permute(0, 3, 1, 2, 4)
    res = res.reshape(len(reqs), q_pad, num_heads, head_dim).to(out.dtype)
    for g, r in enumerate(reqs):
        n_q = starts[r + 1] - starts[r]
        out[starts[r] : starts[r + 1]] = res[g, :n_q]
