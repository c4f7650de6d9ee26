"""The torch reference attention over the paged cache: equal to dense causal attention on ragged batches, and
bitwise independent of how a request's tokens are chunked or batched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.attention.base import AttentionMetadata, KVCache
from dspark.attention.torch_ref import TorchAttention

H, HKV, D, BS, NB = 9, 3, 64, 16, 96


def _step(
    backend: TorchAttention,
    cache: KVCache,
    reqs: list[tuple[list[int], int, int]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """reqs: (block ids, first position, number of new tokens); q/k/v: this step's rows, requests back to back."""
    slots, starts, lens = [], [0], []
    for blocks, first, n in reqs:
        slots += [blocks[p // BS] * BS + p % BS for p in range(first, first + n)]
        starts.append(starts[-1] + n)
        lens.append(first + n)
    width = max(len(b) for b, _, _ in reqs)
    meta = AttentionMetadata(
        num_actual_tokens=len(slots),
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(lens),
        block_tables=torch.tensor([b + [0] * (width - len(b)) for b, _, _ in reqs]),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
        max_query_len=max(n for _, _, n in reqs),
        max_seq_len=max(lens),
    )
    backend.prepare(meta, HKV, H, BS)
    return backend.forward(q, k, v, cache, meta, D**-0.5)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one whole sequence: [T, H, D]."""
    kx, vx = (t.repeat_interleave(H // HKV, dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kx.transpose(0, 1), vx.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, D, generator=g), torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)


def _run(lengths: list[int], chunk_plan: list[list[int]], seeds: list[int] | None = None) -> list[torch.Tensor]:
    """Process len(lengths) requests; step s gives request r chunk_plan[s][r] new tokens (0: not scheduled).
    Request r's q/k/v come from seed seeds[r], so the same request can be run alone or among others."""
    seeds = seeds or list(range(len(lengths)))
    data = [_data(n, s) for n, s in zip(lengths, seeds, strict=True)]
    perm = torch.randperm(NB, generator=torch.Generator().manual_seed(sum(seeds))).tolist()  # scattered blocks
    tables, used = [], 0
    for n in lengths:
        tables.append(perm[used : used + -(-n // BS)])
        used += -(-n // BS)
    cache = KVCache(torch.zeros(NB, BS, HKV, D), torch.zeros(NB, BS, HKV, D))
    backend, done = TorchAttention(), [0] * len(lengths)
    outs = [torch.zeros(n, H, D) for n in lengths]
    for plan in chunk_plan:
        reqs = [(r, n) for r, n in enumerate(plan) if n]
        q = torch.cat([data[r][0][done[r] : done[r] + n] for r, n in reqs])
        k = torch.cat([data[r][1][done[r] : done[r] + n] for r, n in reqs])
        v = torch.cat([data[r][2][done[r] : done[r] + n] for r, n in reqs])
        o = _step(backend, cache, [(tables[r], done[r], n) for r, n in reqs], q, k, v)
        row = 0
        for r, n in reqs:
            outs[r][done[r] : done[r] + n] = o[row : row + n]
            row, done[r] = row + n, done[r] + n
    assert done == lengths
    return outs


def test_matches_dense_attention_on_a_ragged_batch() -> None:
    lengths = [1, 5, 17, 64, 130, 200]
    outs = _run(lengths, [[1, 3, 17, 40, 100, 150], [0, 2, 0, 24, 30, 50]])
    for r, (n, out) in enumerate(zip(lengths, outs, strict=True)):
        torch.testing.assert_close(out, _dense(*_data(n, r)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "plan",
    [
        [[130]],
        [[64], [66]],
        [[97]] + [[1]] * 33,
        [[5], [7], [64], [54]],
        [[8]] * 16 + [[2]],
        [[96], [10], [24]],
    ],
)
def test_chunking_does_not_change_any_bit(plan: list[list[int]]) -> None:
    ref = _run([130], [[1]] * 130)[0]  # pure decode, one token at a time
    assert torch.equal(_run([130], plan)[0], ref)


def test_batch_neighbours_do_not_change_any_bit() -> None:
    alone = _run([40], [[30], [1], [1], [8]], seeds=[7])[0]
    mixed = _run([7, 40, 300], [[7, 30, 200], [0, 1, 1], [0, 1, 50], [0, 8, 49]], seeds=[3, 7, 5])[1]
    decode_mix = _run([40, 300], [[30, 299], [1, 1], [1, 0], [8, 0]], seeds=[7, 5])[0]
    assert torch.equal(alone, mixed)
    assert torch.equal(alone, decode_mix)
