"""The Triton paged-attention backend against the torch reference, on ragged batches that mix prefill chunks (with
context), decodes, verifications, non-causal draft blocks, empty request slots and padding tokens.

On CPU the kernels run under the Triton interpreter. TRITON_INTERPRET=1 must be set before triton.jit decorates them
and would turn every kernel of the process into an interpreted one, so those cases run in one subprocess (this file
run as a script) and each test reads its case's verdict. With CUDA, the same cases and larger ones run on the GPU,
plus a CUDA-graph capture replayed with other batch contents.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from helpers import interpreted_verdicts, run_interpreted

pytest.importorskip("triton")

from dspark.attention.base import AttentionMetadata, KVCache
from dspark.attention.torch_ref import TorchAttention

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    name: str
    reqs: tuple[tuple[int, int], ...]  # (seq_len after the step, query length) per request slot; (0, 0): empty slot
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "float32"
    causal: bool = True
    num_padding: int = 0  # padding tokens after the last request's (slot -1)
    # Each is run and compared with the reference and with the first; None: the backend's own choice.
    splits: tuple[int | None, ...] = (1,)
    max_query_bound: int = 0  # > 0: meta.max_query_len passed as this upper bound instead of the true maximum
    max_seq_bound: int = 0
    seed: int = 0


MIXED = ((40, 12), (70, 1), (33, 5), (0, 0), (1, 1), (20, 20), (150, 8))
CASES = [
    # SmolLM2's shape: prefill chunks with and without context, decodes, verifications, an empty slot, padding.
    Case("mixed-gqa3-fp32", MIXED, num_padding=3, splits=(1, 3)),
    Case("mixed-gqa3-bf16", MIXED, dtype="bfloat16", num_padding=3, splits=(1, 3), seed=1),
    # Verification lengths 2..8 beside decodes, group 4, tiles of 64 rows although no query is longer than 8.
    Case(
        "verify-gqa4-d32",
        tuple((17 * k + 3, k) for k in range(1, 9)),
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        num_padding=2,
        splits=(1, 2),
        max_query_bound=64,
        seed=2,
    ),
    # DSpark draft blocks: every query sees its whole request, including the keys after it.
    Case(
        "noncausal-gqa4-d32-fp32",
        ((30, 7), (7, 7), (64, 7), (0, 0), (100, 7)),
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        causal=False,
        num_padding=5,
        splits=(1, 4),
        seed=3,
    ),
    Case(
        "noncausal-gqa3-bf16",
        ((9, 7), (71, 7)),
        dtype="bfloat16",
        causal=False,
        num_padding=1,
        splits=(1, 2),
        seed=4,
    ),
    # No GQA: 64 query tokens per block, so the 70-token chunk spans two blocks of one request.
    Case("mha-d32", ((100, 70), (129, 1), (0, 0)), num_heads=2, num_kv_heads=2, head_dim=32, splits=(1, 2), seed=5),
    # Long decodes cut into many splits, most of them past the short request's keys (neutral partials).
    Case(
        "decode-splits-bf16",
        ((300, 1), (5, 1), (257, 1)),
        dtype="bfloat16",
        num_padding=4,
        splits=(1, 4, 16),
        max_seq_bound=4096,
        seed=6,
    ),
    Case("block-size-32", ((90, 3), (33, 33)), block_size=32, splits=(1, 2), seed=7),
    # Queries starting just before, at and after a tile boundary (the unmasked/masked split of the key loop): 64-key
    # tiles for 64-row programs, 128-key tiles for 32-row ones.
    Case(
        "tile-boundaries-64",
        ((66, 4), (66, 3), (66, 2), (66, 1), (136, 9), (128, 1), (190, 64)),
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        splits=(1, 2),
        seed=9,
    ),
    Case(
        "tile-boundaries-128",
        ((130, 4), (130, 3), (130, 2), (130, 1), (265, 9), (256, 1)),
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        splits=(1, 2),
        seed=10,
    ),
    # Nothing but empty slots and padding: no program attends, nothing is written, rows are zeros.
    Case("all-padding", ((0, 0), (0, 0)), num_padding=6, splits=(1, 2), seed=8),
]
CASES_BY_NAME = {c.name: c for c in CASES}


@dataclass
class Batch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor
    cache: KVCache  # initial contents, random (untouched slots must keep them)
    meta: AttentionMetadata  # what the Triton backend gets: every slot, padding, poisoned host fields
    ref_meta: AttentionMetadata | None  # what the reference gets: non-empty requests only (None: there are none)
    num_actual: int


def make_batch(case: Case, device: torch.device) -> Batch:
    g = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, case.dtype)
    bs = case.block_size
    need = [-(-seq // bs) for seq, _ in case.reqs]
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()  # scattered, non-contiguous blocks
    tables, slots, starts, lens, used = [], [], [0], [], 0
    for (seq, n), nb in zip(case.reqs, need, strict=True):
        tables.append(perm[used : used + nb])
        used += nb
        slots += [tables[-1][p // bs] * bs + p % bs for p in range(seq - n, seq)]
        starts.append(starts[-1] + n)
        lens.append(seq)
    num_actual = len(slots)
    num_tokens = num_actual + case.num_padding
    width = max(need) + 2  # wider than any request needs, as a CUDA graph's table is

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    def i32(x: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32, device=device)

    q = randn(num_tokens, case.num_heads, case.head_dim)
    k, v = randn(num_tokens, case.num_kv_heads, case.head_dim), randn(num_tokens, case.num_kv_heads, case.head_dim)
    cache_shape = (len(perm), bs, case.num_kv_heads, case.head_dim)
    cache = KVCache(randn(*cache_shape), randn(*cache_shape))
    slot_mapping = torch.tensor(slots + [-1] * case.num_padding, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        num_actual_tokens=-1,  # poisoned: the backend must not read it, nor the host lists below
        slot_mapping=slot_mapping,
        query_start_loc=i32(starts),
        seq_lens=i32(lens),
        block_tables=i32([t + [0] * (width - len(t)) for t in tables]),
        query_start_loc_cpu=[],
        seq_lens_cpu=[],
        max_query_len=case.max_query_bound or max(n for _, n in case.reqs) or 1,
        max_seq_len=case.max_seq_bound or max(lens) or 1,
        causal=case.causal,
    )
    live = [r for r, (_, n) in enumerate(case.reqs) if n]
    ref_meta = None
    if live:
        ref_starts = [starts[r] for r in live] + [num_actual]
        ref_lens = [lens[r] for r in live]
        ref_meta = AttentionMetadata(
            num_actual_tokens=num_actual,
            slot_mapping=slot_mapping,
            query_start_loc=i32(ref_starts),
            seq_lens=i32(ref_lens),
            block_tables=i32([tables[r] + [0] * (width - len(tables[r])) for r in live]),
            query_start_loc_cpu=ref_starts,
            seq_lens_cpu=ref_lens,
            max_query_len=max(n for _, n in case.reqs),
            max_seq_len=max(ref_lens),
            causal=case.causal,
        )
    return Batch(q, k, v, cache, meta, ref_meta, num_actual)


def clone_cache(cache: KVCache) -> KVCache:
    return KVCache(cache.key.clone(), cache.value.clone())


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}


def check_case(case: Case, device: torch.device) -> None:
    """Raises AssertionError unless every split count matches the reference, in the output and in the cache."""
    from dspark.attention.triton_backend import TritonAttention

    b = make_batch(case, device)
    n, scale = b.num_actual, case.head_dim**-0.5
    want_cache = clone_cache(b.cache)
    want = torch.zeros_like(b.q)
    if b.ref_meta is not None:
        ref = TorchAttention()
        ref.prepare(b.ref_meta, case.num_kv_heads, case.num_heads, case.block_size)
        want = ref.forward(b.q, b.k, b.v, want_cache, b.ref_meta, scale)

    # Where the step writes: every slot of a real token, and nothing else.
    written = torch.zeros(b.cache.key.shape[:2], dtype=torch.bool, device=device).view(-1)
    written[b.meta.slot_mapping[:n]] = True
    written = written.view(b.cache.key.shape[:2])
    outs = []
    for splits in case.splits:
        cache = clone_cache(b.cache)
        backend = TritonAttention(num_splits=splits)
        backend.prepare(b.meta, case.num_kv_heads, case.num_heads, case.block_size)
        out = backend.forward(b.q, b.k, b.v, cache, b.meta, scale)
        for got, before, name in ((cache.key, b.cache.key, "key"), (cache.value, b.cache.value, "value")):
            assert torch.equal(got[~written], before[~written]), f"splits={splits}: {name} cache changed off the slots"
        assert torch.equal(cache.key, want_cache.key), f"splits={splits}: key cache differs from the reference"
        assert torch.equal(cache.value, want_cache.value), f"splits={splits}: value cache differs from the reference"
        assert out.shape == b.q.shape and out.dtype == b.q.dtype
        assert torch.equal(out[n:], torch.zeros_like(out[n:])), f"splits={splits}: padding rows are not zeros"
        torch.testing.assert_close(
            out[:n], want[:n], **tolerance(b.q.dtype), msg=lambda m, s=splits: f"splits={s}: {m}"
        )
        outs.append(out)
    for splits, out in zip(case.splits[1:], outs[1:], strict=True):
        torch.testing.assert_close(out, outs[0], **tolerance(b.q.dtype), msg=lambda m, s=splits: f"{s} vs 1 split: {m}")


# ---- CPU: the Triton interpreter, in a subprocess ------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreted(request: pytest.FixtureRequest) -> dict[str, str]:
    """Verdicts of the selected interpreter cases, all computed in one subprocess (one import of torch and triton)."""
    return interpreted_verdicts(request, "test_interpreted_kernels_match_the_reference", __file__)


@pytest.mark.parametrize("name", list(CASES_BY_NAME))
def test_interpreted_kernels_match_the_reference(interpreted: dict[str, str], name: str) -> None:
    assert interpreted[name] == "ok", interpreted[name]


def test_num_splits_follows_the_launch_shape_only() -> None:
    from dspark.attention.triton_backend import MAX_SPLITS, choose_num_splits

    assert choose_num_splits(3, 4096, 132) == MAX_SPLITS  # one decode: as many splits as allowed
    assert choose_num_splits(3 * 1024, 4096, 132) == 1  # the SMs are busy already
    assert choose_num_splits(48, 4096, 132) == 8  # cdiv(4 * 132, 48) = 11, rounded down to a power of two
    assert choose_num_splits(3, 200, 132) == 1  # too few keys to split
    assert all(choose_num_splits(p, 8192, 132) in (1, 2, 4, 8, 16, 32) for p in range(1, 1000))


# ---- GPU -----------------------------------------------------------------------------------------------------------


def _random_case(name: str, seed: int, num_reqs: int, max_context: int, **kw: object) -> Case:
    """A random mix of prefill chunks (some with context), decodes, verifications and empty slots."""
    g = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    reqs = []
    for _ in range(num_reqs):
        kind = randint(0, 9)
        if kind == 0:
            reqs.append((0, 0))
        elif kind <= 2:
            n = randint(2, 300)
            reqs.append((n + randint(0, max_context) * randint(0, 1), n))
        else:
            n = 1 if kind <= 5 else randint(2, 8)
            reqs.append((randint(n, max_context), n))
    return Case(name, tuple(reqs), num_padding=randint(0, 40), seed=seed, **kw)  # type: ignore[arg-type]


GPU_CASES = [
    *(replace(c, splits=(*c.splits, None)) for c in CASES),
    _random_case("rand-smollm2-bf16", 10, 64, 3000, dtype="bfloat16", splits=(1, None, 8)),
    _random_case("rand-smollm2-fp32", 11, 48, 2000, splits=(1, None)),
    _random_case("rand-gqa4-d128-bf16", 12, 40, 2500, num_heads=16, num_kv_heads=4, head_dim=128, dtype="bfloat16"),
    _random_case("rand-mha-d64-bf16", 13, 24, 1500, num_heads=4, num_kv_heads=4, dtype="bfloat16", splits=(1, 4)),
    _random_case("rand-noncausal-bf16", 14, 32, 1000, dtype="bfloat16", causal=False, splits=(1, None)),
    Case("decode-b1-long", ((4000, 1),), dtype="bfloat16", splits=(1, None), max_seq_bound=8192),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.name for c in GPU_CASES])
def test_gpu_kernels_match_the_reference(case: Case) -> None:
    check_case(case, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_splits", [None, 1])
def test_gpu_cuda_graph_replays_other_batches_like_eager(num_splits: int | None) -> None:
    """Capture prepare() and two layers' forwards once; replay with other lengths, tables and empty slots in the same
    static buffers: bit-identical to eager runs with the same upper bounds, and close to the reference."""
    from dspark.attention.triton_backend import TritonAttention

    dev = torch.device("cuda")
    H, HKV, D, BS = 9, 3, 64, 16
    T, R, MAX_LEN, Q = 96, 16, 2048, 8  # static token count, request slots, max_model_len, longest query
    num_blocks = R * MAX_LEN // BS
    dtype = torch.bfloat16
    slots = torch.full((T,), -1, dtype=torch.int64, device=dev)
    qsl = torch.zeros(R + 1, dtype=torch.int32, device=dev)
    lens = torch.zeros(R, dtype=torch.int32, device=dev)
    tables = torch.zeros(R, MAX_LEN // BS, dtype=torch.int32, device=dev)
    q, k, v = (torch.zeros(T, h, D, dtype=dtype, device=dev) for h in (H, HKV, HKV))
    caches = [KVCache(*(torch.randn(num_blocks, BS, HKV, D, device=dev).to(dtype) for _ in "kv")) for _ in "ab"]

    def meta() -> AttentionMetadata:
        return AttentionMetadata(-1, slots, qsl, lens, tables, [], [], Q, MAX_LEN)

    def step(backend: TritonAttention, m: AttentionMetadata, layer_caches: list[KVCache]) -> list[torch.Tensor]:
        backend.prepare(m, HKV, H, BS)
        return [backend.forward(q, k, v, c, m, D**-0.5) for c in layer_caches]

    def fill(seed: int) -> None:
        """A random batch in the static buffers: decodes, verifications, short prefill chunks, empty slots."""
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(num_blocks, generator=g)
        used, tok, s, starts, seq = 0, 0, [], [0], []
        for _ in range(R):
            n = min(int(torch.randint(0, Q + 1, (1,), generator=g)), T - tok)
            length = int(torch.randint(n, MAX_LEN + 1, (1,), generator=g)) if n else 0
            nb = -(-length // BS)
            row = perm[used : used + nb]
            tables[len(seq)].zero_()
            tables[len(seq), :nb] = row.to(dev, torch.int32)
            used += nb
            s += [int(row[p // BS]) * BS + p % BS for p in range(length - n, length)]
            tok += n
            starts.append(tok)
            seq.append(length)
        slots.fill_(-1)
        slots[: len(s)] = torch.tensor(s, device=dev)
        qsl.copy_(torch.tensor(starts, dtype=torch.int32))
        lens.copy_(torch.tensor(seq, dtype=torch.int32))
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=g).to(dtype))

    fill(0)
    backend = TritonAttention(num_splits=num_splits)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(backend, meta(), caches)  # compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            static_outs = step(backend, meta(), caches)
    torch.cuda.current_stream().wait_stream(stream)

    for seed in (1, 2, 3):
        fill(seed)
        before = [clone_cache(c) for c in caches]
        graph.replay()
        got = [o.clone() for o in static_outs]
        after = [clone_cache(c) for c in caches]
        eager_caches = [clone_cache(c) for c in before]
        want = step(TritonAttention(num_splits=num_splits), meta(), eager_caches)
        for g_out, w_out, c_graph, c_eager in zip(got, want, after, eager_caches, strict=True):
            assert torch.equal(g_out, w_out)
            assert torch.equal(c_graph.key, c_eager.key) and torch.equal(c_graph.value, c_eager.value)
        # And the reference on the same (non-empty) requests.
        starts, seq = qsl.tolist(), lens.tolist()
        live = [r for r in range(R) if starts[r + 1] > starts[r]]
        ref_starts = [starts[r] for r in live] + [starts[-1]]
        ref_meta = AttentionMetadata(
            starts[-1],
            slots,
            torch.tensor(ref_starts, dtype=torch.int32, device=dev),
            torch.tensor([seq[r] for r in live], dtype=torch.int32, device=dev),
            tables[live],
            ref_starts,
            [seq[r] for r in live],
            Q,
            max(seq),
        )
        ref = TorchAttention()
        ref.prepare(ref_meta, HKV, H, BS)
        ref_cache = clone_cache(before[0])
        expected = ref.forward(q, k, v, ref_cache, ref_meta, D**-0.5)
        n = starts[-1]
        torch.testing.assert_close(got[0][:n], expected[:n], **tolerance(dtype))
        assert torch.equal(got[0][n:], torch.zeros_like(got[0][n:]))
        assert torch.equal(after[0].key, ref_cache.key)


if __name__ == "__main__":
    print(json.dumps(run_interpreted(lambda name: check_case(CASES_BY_NAME[name], torch.device("cpu")), sys.argv[1:])))
