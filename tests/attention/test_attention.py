"""Attention over the paged cache on CPU: the torch reference equals dense causal attention on ragged batches and is
bitwise independent of how a request's tokens are chunked or batched; the SDPA backend (the default) equals dense
attention on the same batches and chunkings, to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.attention import sdpa
from dspark.attention.base import AttentionMetadata, KVCache
from dspark.attention.sdpa import SdpaAttention
from dspark.attention.torch_ref import TorchAttention

H, HKV, D, BS, NB = 9, 3, 64, 16, 96


def _step(
    backend: TorchAttention | SdpaAttention,
    cache: KVCache,
    reqs: list[tuple[list[int], int, int]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
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
        query_start_loc=torch.tensor(starts, dtype=torch.int32),  # the model runner's dtypes
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([b + [0] * (width - len(b)) for b, _, _ in reqs], dtype=torch.int32),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
        max_query_len=max(n for _, _, n in reqs),
        max_seq_len=max(lens),
        causal=causal,
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


def _run(
    lengths: list[int],
    chunk_plan: list[list[int]],
    seeds: list[int] | None = None,
    backend_type: type[TorchAttention] | type[SdpaAttention] = TorchAttention,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Process len(lengths) requests; step s gives request r chunk_plan[s][r] new tokens (0: not scheduled).
    Request r's q/k/v come from seed seeds[r] (cast to dtype), so the same request can be run alone or among others."""
    seeds = seeds or list(range(len(lengths)))
    data = [tuple(t.to(dtype) for t in _data(n, s)) for n, s in zip(lengths, seeds, strict=True)]
    perm = torch.randperm(NB, generator=torch.Generator().manual_seed(sum(seeds))).tolist()  # scattered blocks
    tables, used = [], 0
    for n in lengths:
        tables.append(perm[used : used + -(-n // BS)])
        used += -(-n // BS)
    cache = KVCache(torch.zeros(NB, BS, HKV, D, dtype=dtype), torch.zeros(NB, BS, HKV, D, dtype=dtype))
    backend, done = backend_type(), [0] * len(lengths)
    outs = [torch.zeros(n, H, D, dtype=dtype) for n in lengths]
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


@pytest.mark.parametrize(
    ("lengths", "plan"),
    [
        ([1, 5, 17, 64, 130, 200], [[1, 3, 17, 40, 100, 150], [0, 2, 0, 24, 30, 50]]),  # prefill, then chunks
        ([130], [[97]] + [[1]] * 33),  # a prompt, then decode
        ([40, 300, 9], [[30, 280, 1], [1, 1, 8], [8, 19, 0], [1, 0, 0]]),  # decode and verification-long queries mixed
        ([33, 20], [[17, 3], [16, 17]]),  # a long chunk after cached keys, beside a short query
        ([50, 61, 300], [[49, 60, 299], [1, 1, 1]]),  # pure decode: queries and output read as views
        ([40, 41], [[36, 37], [4, 4]]),  # verification of equal drafts, in order
        ([100, 101, 102, 103], [[96, 97, 98, 99], [4, 4, 4, 4]]),  # the same over enough requests for the matmuls
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_matches_dense_attention(
    lengths: list[int], plan: list[list[int]], dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    matmul_calls = []
    real = sdpa._attend_matmul
    monkeypatch.setattr(sdpa, "_attend_matmul", lambda *a: matmul_calls.append(a[1].shape) or real(*a))
    outs = _run(lengths, plan, backend_type=SdpaAttention, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: q, k, v and the output each rounded to 8 bits
    for r, (n, out) in enumerate(zip(lengths, outs, strict=True)):
        ref = _dense(*(t.to(dtype).float() for t in _data(n, r)))
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    # fp32 always takes SDPA; a bf16 short call over enough (request, key) pairs takes the two matmuls (once a layer),
    # with several queries a request only over 4 requests or more
    expected, done = 0, [0] * len(lengths)
    for step in plan:
        short = [r for r, n in enumerate(step) if 0 < n <= sdpa.SHORT_QUERY]
        keys = max((done[r] + step[r] for r in short), default=0)
        q_pad = max((step[r] for r in short), default=0)
        enough = len(short) * keys >= sdpa.MATMUL_MIN_KEYS and (q_pad == 1 or len(short) >= 4)
        expected += dtype == torch.bfloat16 and enough
        done = [d + n for d, n in zip(done, step, strict=True)]
    assert len(matmul_calls) == expected


def _prefill_kernel() -> bool:
    with torch.inference_mode():
        return sdpa.cpu_kernels.prefill_supported(torch.empty(1, H, D, dtype=torch.bfloat16))


@pytest.mark.skipif(not _prefill_kernel(), reason="no AVX512-BF16 prefill kernel on this CPU")
def test_sdpa_takes_the_bf16_prefill_kernel_for_long_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """In inference (how the engine runs), a bf16 prompt chunk of more than SHORT_QUERY tokens goes to the C kernel,
    first chunks and chunks after cached keys alike, beside short queries: equal to dense attention within bf16."""
    calls: list[int] = []
    real = sdpa.cpu_kernels.prefill_attention
    monkeypatch.setattr(sdpa.cpu_kernels, "prefill_attention", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    lengths, plan = [150, 40, 90], [[64, 17, 3], [50, 1, 40], [36, 22, 47]]
    with torch.inference_mode():
        outs = _run(lengths, plan, backend_type=SdpaAttention, dtype=torch.bfloat16)
    assert calls == [64, 17, 50, 40, 36, 22, 47]
    for r, (n, out) in enumerate(zip(lengths, outs, strict=True)):
        ref = _dense(*(t.to(torch.bfloat16).float() for t in _data(n, r)))
        torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("inference", [False, True], ids=["torch-calls", "kernel"])
def test_sdpa_equals_the_reference_on_a_non_causal_block(inference: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DSpark draft block attends to its whole context and to itself both ways (causal=False): through SDPA's own
    calls, and in inference (how the engine runs) through the C paged-attention kernel where it builds."""
    calls: list[bool] = []
    real = sdpa.cpu_kernels.paged_attention
    monkeypatch.setattr(sdpa.cpu_kernels, "paged_attention", lambda *a: calls.append(a[-1]) or real(*a))
    g = torch.Generator().manual_seed(11)
    cache = KVCache(torch.randn(NB, BS, HKV, D, generator=g), torch.randn(NB, BS, HKV, D, generator=g))
    reqs = [([3, 9, 4], 30, 7), ([12, 1], 10, 7), ([7, 8, 20, 21, 22], 70, 7)]  # (blocks, first position, block of 7)
    n = sum(q for _, _, q in reqs)
    q, k, v = (
        torch.randn(n, H, D, generator=g),
        torch.randn(n, HKV, D, generator=g),
        torch.randn(n, HKV, D, generator=g),
    )
    with torch.inference_mode(inference):
        outs = [
            _step(backend, KVCache(cache.key.clone(), cache.value.clone()), reqs, q, k, v, causal=False)
            for backend in (TorchAttention(), SdpaAttention())
        ]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert calls == ([False] if inference and sdpa.cpu_kernels.lib() is not None else [])  # causal=False
