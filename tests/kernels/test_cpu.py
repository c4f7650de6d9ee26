"""The fast CPU path's C kernels (dspark/kernels/cpu.py) against the torch formulas they replace: fp32 to reduction
order (rotary bit for bit), bf16 within a rounding; decode attention against attention over the gathered context;
the fallback when they cannot be built; and a model's decode and verification through them against the torch path."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dspark.kernels import cpu
from dspark.models import cpu_gemm
from dspark.models.llama import RMSNorm, Rotary, apply_rotary, use_fast_cpu_path

pytestmark = pytest.mark.skipif(cpu.lib() is None, reason="no C compiler: the kernels cannot be built here")
DTYPES = [torch.float32, torch.bfloat16]
ATOL = {torch.float32: 1e-5, torch.bfloat16: 0.05}


@pytest.fixture(autouse=True)
def _inference() -> Iterator[None]:
    with torch.inference_mode():
        yield


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (torch.rand(576, generator=g) + 0.5).to(dtype)
    x, delta = torch.randn(7, 576, generator=g).to(dtype), torch.randn(7, 576, generator=g).to(dtype)
    torch.testing.assert_close(cpu.rms_norm(x, norm.weight, 1e-5), norm(x), atol=ATOL[dtype], rtol=1e-5)
    h, total = cpu.add_rms_norm(delta, x, norm.weight, 1e-5)
    assert torch.equal(total, x + delta)  # the sum rounds to the dtype as torch's add does
    torch.testing.assert_close(h, norm(x + delta), atol=ATOL[dtype], rtol=1e-5)
    # a strided input (rows of a wider tensor) reads its rows where they are
    wide = torch.randn(7, 1000, generator=g).to(dtype)
    torch.testing.assert_close(cpu.rms_norm(wide[:, 10:586], norm.weight, 1e-5), norm(wide[:, 10:586]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_equals_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    rope = Rotary(64, 10000.0, 4096)
    positions = torch.randint(0, 4096, (5,), generator=g)
    qkv = torch.randn(5, 15 * 64, generator=g).to(dtype)  # 9 q heads, 3 k heads, then 3 v heads
    expected = apply_rotary(qkv[:, : 12 * 64].view(5, 12, 64), rope(positions))
    got = qkv.clone()
    cpu.rotary_(got[:, : 12 * 64].view(5, 12, 64), *rope(positions))
    # the same operations in the same order: equal bits in both dtypes
    assert torch.equal(got[:, : 12 * 64].view(5, 12, 64), expected)
    assert torch.equal(got[:, 12 * 64 :], qkv[:, 12 * 64 :])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    gate_up = (torch.randn(6, 2 * 1536, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu.silu_mul(gate_up), F.silu(gate) * up, atol=ATOL[dtype] / 5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_first_of_ties_and_nan(dtype: torch.dtype) -> None:
    x = torch.randn(5, 49152, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[1, 100] = x[1, 7] = 50.0  # a tie: the first wins
    x[2, 3000] = float("nan")  # NaN counts as the largest, as in torch
    x[3] = -float("inf")
    assert torch.equal(cpu.argmax(x), x.argmax(dim=-1))
    assert cpu.argmax(x)[1].item() == 7


def _markov_reference(
    base: torch.Tensor,
    h: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    cw: torch.Tensor,
    cb: float,
    tokens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position, from the previous token the kernel chose (the anchor first, in column 0 of tokens): the corrected
    logits [R, V], each row's best value, and the confidence logits in fp64 sums."""
    e = w1[tokens]  # [R, rank]
    logits = base + F.linear(e, w2).float()
    conf = (torch.cat([h, e], dim=-1).double() @ cw.double()) + cb
    return logits, logits.max(dim=-1).values, conf


@pytest.mark.parametrize("dtype", DTYPES)
def test_markov_block_drafts_left_to_right_with_the_correction(dtype: torch.dtype) -> None:
    """A DSpark block's greedy drafts in one call: at each position the argmax of base + (W1[prev] @ W2^T).to(dtype),
    prev the previous draft (the anchor first), and the confidence logit of [h; W1[prev]]; rank 32, a vocabulary the
    threads split unevenly. fp32 takes exactly torch's argmax; bf16 rounds the correction after a sum in another
    order, so a near-tie may go either way."""
    g = torch.Generator().manual_seed(9)
    vocab, rank, hidden, k = 49157, 32, 24, 7
    base = torch.randn(3, k, vocab, generator=g) * 3
    h = torch.randn(3, k, hidden, generator=g).to(dtype)
    w1 = torch.randn(vocab, rank, generator=g).to(dtype)
    w2 = (torch.randn(vocab, rank, generator=g) / 4).to(dtype)
    cw = torch.randn(hidden + rank, generator=g).to(dtype)
    anchors = torch.tensor([5, 49000, 17])
    tokens, conf = cpu.markov_block(base, h, w1, w2.t().contiguous(), anchors, cw, 0.25)
    assert tokens.shape == (3, k) and conf is not None and conf.shape == (3, k)
    prev = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)
    for j in range(k):
        logits, best, expected_conf = _markov_reference(base[:, j], h[:, j], w1, w2, cw, 0.25, prev[:, j])
        chosen = logits.gather(1, tokens[:, j, None])[:, 0]
        if dtype == torch.float32:
            assert torch.equal(tokens[:, j], logits.argmax(dim=-1)), j
        else:
            assert torch.all(chosen >= best - 0.02 * best.abs()), j
        tol = 1e-4 if dtype == torch.float32 else 0.05
        torch.testing.assert_close(conf[:, j].double(), expected_conf, atol=tol, rtol=tol)
    no_head = cpu.markov_block(base, h, w1, w2.t().contiguous(), anchors, None, 0.0)
    assert torch.equal(no_head[0], tokens) and no_head[1] is None


def test_markov_block_ties_go_to_the_first_and_a_nan_wins() -> None:
    vocab, rank = 49157, 32
    base = torch.zeros(2, 1, vocab)
    base[0, 0, 40000] = base[0, 0, 30] = 5.0  # a tie across the threads' halves: the first
    base[1, 0, 45000] = float("nan")
    base[1, 0, 3] = 100.0
    w1, w2t, h = torch.zeros(vocab, rank), torch.zeros(rank, vocab), torch.zeros(2, 1, 4)
    tokens, _ = cpu.markov_block(base, h, w1, w2t, torch.tensor([0, 1]), None, 0.0)
    assert tokens[:, 0].tolist() == [30, 45000]


def test_greedy_block_drafts_through_the_kernel_equal_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """sample_block_with on the fast CPU path (MarkovHead.pack_for_cpu) drafts the same greedy tokens and confidence
    logits as the per-position GEMM + add + argmax and confidence head it replaces (fp32), in one kernel call."""
    from dspark.speculative.drafters.dspark.confidence import ConfidenceHead
    from dspark.speculative.drafters.dspark.markov import MarkovHead, sample_block_with

    g = torch.Generator().manual_seed(10)
    head, confidence = MarkovHead(1000, 16), ConfidenceHead(8, 16)
    for p in [*head.parameters(), *confidence.parameters()]:
        p.data = torch.randn(p.shape, generator=g)
    base, h = torch.randn(3, 7, 1000, generator=g) * 2, torch.randn(3, 7, 8, generator=g)
    anchors, temps, greedy = torch.tensor([1, 2, 3]), torch.ones(3), torch.ones(3, dtype=torch.bool)
    with torch.inference_mode():
        plain = sample_block_with(base, h, anchors, head, confidence, temps, greedy, None)
        head.pack_for_cpu()
        calls = []
        real = cpu.markov_block
        monkeypatch.setattr(cpu, "markov_block", lambda *a: calls.append(1) or real(*a))
        fused = sample_block_with(base, h, anchors, head, confidence, temps, greedy, None)
    assert len(calls) == 1 and torch.equal(fused.tokens, plain.tokens)
    assert fused.confidence_logits is not None and plain.confidence_logits is not None
    torch.testing.assert_close(fused.confidence_logits, plain.confidence_logits, atol=1e-5, rtol=1e-5)


def _paged(num_reqs: int, lens: list[int], hkv: int, d: int, bs: int, dtype: torch.dtype, g: torch.Generator):
    """Caches with random contents and each request's blocks scattered (disjoint) through them."""
    per = max(-(-n // bs) for n in lens)
    blocks = torch.randperm(num_reqs * per + 5, generator=g)[: num_reqs * per].view(num_reqs, per).int()
    shape = (num_reqs * per + 5, bs, hkv, d)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype), blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("h", "hkv", "d", "bs"), [(9, 3, 64, 16), (4, 4, 128, 16), (8, 2, 40, 8), (6, 1, 32, 4)])
def test_decode_attention_against_gathered_context(dtype: torch.dtype, h: int, hkv: int, d: int, bs: int) -> None:
    """Head dims the AVX-512 path takes (32, 64, 128) and one it leaves to the plain loop (40); GQA group sizes 1-6;
    contexts from one key to several blocks, one a padding row (slot -1)."""
    g = torch.Generator().manual_seed(4)
    lens = [1, bs, bs + 1, 5 * bs - 3, 37]
    n = len(lens)
    kc, vc, tables = _paged(n, lens, hkv, d, bs, dtype, g)
    q, k, v = (torch.randn(n, heads, d, generator=g).to(dtype) for heads in (h, hkv, hkv))
    slots = torch.tensor([int(tables[r, (ln - 1) // bs]) * bs + (ln - 1) % bs for r, ln in enumerate(lens)])
    padded = int(slots[2])
    slots[2] = -1  # padding: its key is not written (the cache keeps what it had there, and attends over that)
    before = kc.view(-1, hkv, d)[padded].clone()
    qsl = torch.arange(n + 1, dtype=torch.int32)
    out = cpu.paged_attention(q, k, v, kc, vc, slots, qsl, tables, torch.tensor(lens, dtype=torch.int32), 0.125)
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    for r, ln in enumerate(lens):
        if r != 2:
            assert torch.equal(flat_k[slots[r]], k[r]) and torch.equal(flat_v[slots[r]], v[r])
        rows = torch.tensor([int(tables[r, p // bs]) * bs + p % bs for p in range(ln)])
        keys = flat_k[rows].float().repeat_interleave(h // hkv, dim=1)  # [L, H, d]
        values = flat_v[rows].float().repeat_interleave(h // hkv, dim=1)
        probs = (torch.einsum("hd,lhd->hl", q[r].float(), keys) * 0.125).softmax(-1)
        expected = torch.einsum("hl,lhd->hd", probs, values)
        torch.testing.assert_close(out[r].float(), expected, atol=ATOL[dtype] / 5, rtol=1e-4)
    assert torch.equal(flat_k[padded], before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("h", "hkv", "d"), [(9, 3, 64), (4, 2, 40)])
def test_verification_queries_are_causal(dtype: torch.dtype, h: int, hkv: int, d: int) -> None:
    """Several queries a request (a verification's last token and drafts; a short prompt chunk): query j of n sees
    the keys up to its own position, len - n + j; requests of 1 to 16 queries, one of them a whole context."""
    g = torch.Generator().manual_seed(6)
    bs, lens, nqs = 16, [40, 9, 17, 3, 100], [5, 1, 16, 3, 8]
    kc, vc, tables = _paged(len(lens), lens, hkv, d, bs, dtype, g)
    qsl = torch.tensor([0, *torch.tensor(nqs).cumsum(0).tolist()], dtype=torch.int32)
    tokens = int(qsl[-1])
    q, k, v = (torch.randn(tokens, heads, d, generator=g).to(dtype) for heads in (h, hkv, hkv))
    pairs = list(enumerate(zip(lens, nqs, strict=True)))
    slots = torch.tensor([int(tables[r, p // bs]) * bs + p % bs for r, (ln, nq) in pairs for p in range(ln - nq, ln)])
    out = cpu.paged_attention(q, k, v, kc, vc, slots, qsl, tables, torch.tensor(lens, dtype=torch.int32), 0.125)
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    for r, (ln, nq) in pairs:
        rows = torch.tensor([int(tables[r, p // bs]) * bs + p % bs for p in range(ln)])
        keys = flat_k[rows].float().repeat_interleave(h // hkv, dim=1)
        values = flat_v[rows].float().repeat_interleave(h // hkv, dim=1)
        for j in range(nq):
            t, visible = int(qsl[r]) + j, ln - nq + j + 1
            probs = (torch.einsum("hd,lhd->hl", q[t].float(), keys[:visible]) * 0.125).softmax(-1)
            expected = torch.einsum("hl,lhd->hd", probs, values[:visible])
            torch.testing.assert_close(out[t].float(), expected, atol=ATOL[dtype] / 5, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("h", "hkv", "d"), [(9, 3, 64), (4, 2, 40)])
def test_draft_block_queries_see_every_key(dtype: torch.dtype, h: int, hkv: int, d: int) -> None:
    """Not causal (a DSpark draft block): each of a request's queries sees all of its seq_lens keys, its block's own
    included both ways; blocks of 7 after contexts of 1 to 93 keys, and one padding row (slot -1) past the last."""
    g = torch.Generator().manual_seed(8)
    bs, lens, nqs = 16, [8, 100, 23], [7, 7, 7]
    kc, vc, tables = _paged(len(lens), lens, hkv, d, bs, dtype, g)
    qsl = torch.tensor([0, 7, 14, 21], dtype=torch.int32)
    q, k, v = (torch.randn(22, heads, d, generator=g).to(dtype) for heads in (h, hkv, hkv))
    pairs = list(enumerate(zip(lens, nqs, strict=True)))
    slots = [int(tables[r, p // bs]) * bs + p % bs for r, (ln, nq) in pairs for p in range(ln - nq, ln)]
    slots = torch.tensor([*slots, -1])
    out = cpu.paged_attention(
        q, k, v, kc, vc, slots, qsl, tables, torch.tensor(lens, dtype=torch.int32), 0.125, causal=False
    )
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    assert torch.equal(flat_k[slots[:21]], k[:21]) and torch.equal(flat_v[slots[:21]], v[:21])
    for r, (ln, nq) in pairs:
        rows = torch.tensor([int(tables[r, p // bs]) * bs + p % bs for p in range(ln)])
        keys = flat_k[rows].float().repeat_interleave(h // hkv, dim=1)
        values = flat_v[rows].float().repeat_interleave(h // hkv, dim=1)
        for j in range(nq):
            t = int(qsl[r]) + j
            probs = (torch.einsum("hd,lhd->hl", q[t].float(), keys) * 0.125).softmax(-1)
            expected = torch.einsum("hl,lhd->hd", probs, values)
            torch.testing.assert_close(out[t].float(), expected, atol=ATOL[dtype] / 5, rtol=1e-4)


def test_decode_attention_reads_strided_views() -> None:
    """q, k and v as views of one qkv GEMM output (how the model passes them), and k apart from v (after a k norm)."""
    g = torch.Generator().manual_seed(5)
    lens, hkv, d, bs = [20, 3], 2, 64, 16
    kc, vc, tables = _paged(2, lens, hkv, d, bs, torch.float32, g)
    qkv = torch.randn(2, (4 + 2 * hkv) * d, generator=g)
    q, k, v = qkv[:, : 4 * d].view(2, 4, d), qkv[:, 4 * d : 6 * d].view(2, 2, d), qkv[:, 6 * d :].view(2, 2, d)
    slots = torch.tensor([int(tables[r, (ln - 1) // bs]) * bs + (ln - 1) % bs for r, ln in enumerate(lens)])
    args = (slots, torch.arange(3, dtype=torch.int32), tables, torch.tensor(lens, dtype=torch.int32), 0.125)
    kc2, vc2 = kc.clone(), vc.clone()
    strided = cpu.paged_attention(q, k, v, kc, vc, *args)
    apart = cpu.paged_attention(q.contiguous(), k.contiguous(), v, kc2, vc2, *args)
    assert torch.equal(strided, apart) and torch.equal(kc, kc2)


def _prefill_kernel() -> bool:
    with torch.inference_mode():
        return cpu.prefill_supported(torch.empty(1, 1, 64, dtype=torch.bfloat16))


@pytest.mark.skipif(not _prefill_kernel(), reason="no AVX512-BF16 prefill kernel on this CPU")
@pytest.mark.parametrize(("h", "hkv", "d", "bs"), [(9, 3, 64, 16), (4, 4, 128, 16), (8, 2, 64, 32), (6, 1, 256, 8)])
def test_prefill_attention_against_gathered_context(h: int, hkv: int, d: int, bs: int) -> None:
    """A prompt chunk's causal attention over its scattered blocks: first chunks and chunks after cached keys, of 1 to
    200 queries (row blocks and key tiles cut anywhere), GQA groups of 1 to 6, head dims 64 to 256; q a strided view
    of a qkv output. Within bf16 of fp32 attention over the same bf16 inputs, and no further from it than torch's
    flash kernel plus a bf16 step."""
    g = torch.Generator().manual_seed(7)
    for prefix, n in [(0, 1), (0, 70), (37, 100), (130, 33), (0, 200), (64, 64)]:
        kc, vc, tables = _paged(1, [prefix + n], hkv, d, bs, torch.bfloat16, g)
        qkv = torch.randn(n, (h + 2 * hkv) * d, generator=g).to(torch.bfloat16)
        q = qkv[:, : h * d].view(n, h, d)
        out = cpu.prefill_attention(q, kc, vc, tables[0], prefix, d**-0.5)
        rows = torch.tensor([int(tables[0, p // bs]) * bs + p % bs for p in range(prefix + n)])
        keys = kc.view(-1, hkv, d)[rows].repeat_interleave(h // hkv, dim=1).transpose(0, 1)  # [H, L, d]
        values = vc.view(-1, hkv, d)[rows].repeat_interleave(h // hkv, dim=1).transpose(0, 1)
        mask = torch.arange(prefix + n)[None, :] <= torch.arange(prefix, prefix + n)[:, None]
        expected = F.scaled_dot_product_attention(
            q.transpose(0, 1).float(), keys.float(), values.float(), attn_mask=mask, scale=d**-0.5
        ).transpose(0, 1)
        flash = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, scale=d**-0.5)
        flash_err = (flash.transpose(0, 1).float() - expected).abs().max().item()
        err = (out.float() - expected).abs().max().item()
        assert err <= flash_err + 2**-7, (prefix, n, err, flash_err)
        torch.testing.assert_close(out.float(), expected, atol=0.02, rtol=0.02)


@pytest.mark.skipif(not _prefill_kernel(), reason="no AVX512-BF16 prefill kernel on this CPU")
def test_prefill_attention_keeps_a_nan_in_its_row() -> None:
    """A NaN in a query makes that query head's output NaN, as in torch, and no other row's: on its first key tile
    (the max of a tile drops NaN by lane order) and past it."""
    g = torch.Generator().manual_seed(12)
    kc, vc, tables = _paged(1, [150], 3, 64, 16, torch.bfloat16, g)
    q = torch.randn(150, 9, 64, generator=g).to(torch.bfloat16)
    q[5, 2, 7] = q[140, 4, 0] = float("nan")
    out = cpu.prefill_attention(q, kc, vc, tables[0], 0, 0.125)
    nan_rows = out.isnan().any(dim=-1)
    assert out[5, 2].isnan().all() and out[140, 4].isnan().all()
    assert nan_rows.sum() == 2


def test_prefill_attention_takes_only_what_it_can() -> None:
    """bf16 and a head dim that is a multiple of 64 up to 256, in inference; anything else stays with torch."""
    if not _prefill_kernel():
        pytest.skip("no AVX512-BF16 prefill kernel on this CPU")
    assert cpu.prefill_supported(torch.empty(3, 2, 128, dtype=torch.bfloat16))
    for d in (32, 40, 96, 320):
        assert not cpu.prefill_supported(torch.empty(3, 2, d, dtype=torch.bfloat16))
    assert not cpu.prefill_supported(torch.empty(3, 2, 64))  # fp32
    with torch.enable_grad():
        assert not cpu.prefill_supported(torch.empty(3, 2, 64, dtype=torch.bfloat16))


def _small_linear_kernel() -> bool:
    return cpu.small_linear_pack(torch.zeros(16, 2, dtype=torch.bfloat16)) is not None


@pytest.mark.skipif(not _small_linear_kernel(), reason="no AVX512-BF16 small_linear kernel on this CPU")
@pytest.mark.parametrize(("n", "k"), [(16, 2), (48, 576), (4096, 130)])
def test_small_linear_against_fp32(n: int, k: int) -> None:
    """A few bf16 rows through a packed bf16 weight: fp32 sums of the same bf16 products as an fp32 GEMM (within fp32
    rounding of the sum order), for 1 to 8 rows in one pass and more in several; x a strided view of a wider output.
    A row's result does not depend on how many rows came with it."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    packed = cpu.small_linear_pack(w)
    assert packed is not None
    wide = torch.randn(19, k + 6, generator=g).to(torch.bfloat16)
    alone = [cpu.small_linear(wide[i : i + 1, :k], packed) for i in range(19)]
    for m in (1, 2, 3, 5, 7, 8, 11, 19):
        x = wide[:m, :k]
        out = cpu.small_linear(x, packed)
        assert out.dtype == torch.float32 and out.shape == (m, n)
        expected = x.double() @ w.double().t()
        torch.testing.assert_close(out.double(), expected, atol=1e-4 * k**0.5, rtol=1e-5)
        assert all(torch.equal(out[i], alone[i][0]) for i in range(m)), m


def test_small_linear_takes_only_what_it_can() -> None:
    """bf16 weights on CPU with 16 | N and 2 | K; anything else is None (the caller keeps its GEMM)."""
    if not _small_linear_kernel():
        pytest.skip("no AVX512-BF16 small_linear kernel on this CPU")
    assert cpu.small_linear_pack(torch.zeros(32, 8, dtype=torch.bfloat16)) is not None
    assert cpu.small_linear_pack(torch.zeros(32, 8)) is None  # fp32
    assert cpu.small_linear_pack(torch.zeros(24, 8, dtype=torch.bfloat16)) is None
    assert cpu.small_linear_pack(torch.zeros(32, 7, dtype=torch.bfloat16)) is None


@pytest.mark.skipif(not _small_linear_kernel(), reason="no AVX512-BF16 small_linear kernel on this CPU")
def test_draft_logits_take_small_linear_on_the_fast_bf16_path(tiny_model_dirs: dict[str, Path]) -> None:
    """CausalLM.draft_logits: a block's rows (<= 8) through small_linear on the fast bf16 CPU path, within bf16 of the
    target's own logits; more rows, or the batch-invariant path, keep compute_logits."""
    from dspark.models.loader import load_model

    model = load_model(tiny_model_dirs["llama"], torch.bfloat16, torch.device("cpu"))
    h = torch.randn(12, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.inference_mode():
        reference = model.compute_logits(h, invariant=False)
        assert model.lm_head_small is None and torch.equal(model.draft_logits(h[:7]), reference[:7])  # not packed
        use_fast_cpu_path(model)
        few = model.draft_logits(h[:7])
        assert model.lm_head_small is not None
        assert torch.equal(few, cpu.small_linear(h[:7], model.lm_head_small))
        torch.testing.assert_close(few, reference[:7], atol=0.05, rtol=0.02)
        assert torch.equal(model.draft_logits(h), model.compute_logits(h, invariant=False))


def test_unbuildable_kernels_fall_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No compiler (or DSPARK_CPU_KERNELS=0): lib() is None with one warning, and nothing claims to support a tensor."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu.lib.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="dspark"):
            assert cpu.lib() is None
        assert "CPU kernels unavailable" in caplog.text
        assert not cpu.supports(torch.zeros(2, 2))
        monkeypatch.delenv("CC")
        monkeypatch.setenv("DSPARK_CPU_KERNELS", "0")
        cpu.lib.cache_clear()
        assert cpu.lib() is None
        monkeypatch.delenv("DSPARK_CPU_KERNELS")
        cpu.lib.cache_clear()
        assert cpu.lib() is not None  # built afresh into the new cache
        assert list((tmp_path / "kernels").glob("cpu_kernels-*.so"))
    finally:
        cpu.lib.cache_clear()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_built_in_inference_mode_has_ordinary_weights(dtype: str, tiny_model_dirs: dict[str, Path]) -> None:
    """This module's tests run in inference mode, so this LLM is built in it, as a caller's may be. Its weights are
    ordinary tensors all the same: built as inference tensors and then fused into one GEMM's weight, a projection kept
    an inference tensor's version counter, and with bf16 on a CPU without native bf16 (weights unpacked) its F.linear
    failed ("Inference tensors do not track version counter")."""
    from dspark import LLM, SamplingParams

    assert torch.is_inference_mode_enabled()
    llm = LLM(
        model=str(tiny_model_dirs["llama"]), dtype=dtype, max_model_len=64, num_kv_blocks=16, batch_invariant=False
    )
    for name, p in llm.engine.model.named_parameters():
        assert not p.is_inference(), name
        assert p._version >= 0, name  # raises for an inference tensor's version counter
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("speculation", [False, True], ids=["plain", "ngram"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_decode_through_kernels_matches_torch_path(
    dtype: str, speculation: bool, tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default (fast) CPU path with the kernels against itself without them, on the same prompts (with n-gram
    drafts: verification steps of several queries a request): the kernels are called, and every step's logits agree
    (fp32 to reduction order; bf16 within its tolerance)."""
    from dspark import LLM, SamplingParams

    calls: dict[str, int] = {}
    for name in ("paged_attention", "add_rms_norm", "rotary_", "silu_mul"):
        original = getattr(cpu, name)

        def counted(*args: object, _name: str = name, _original: Callable = original) -> object:
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args)

        monkeypatch.setattr(cpu, name, counted)

    def run() -> list[torch.Tensor]:
        spec = {"method": "ngram", "num_speculative_tokens": 4, "enable_adaptive_verification": False}
        spec = spec if speculation else None
        llm = LLM(model=str(tiny_model_dirs["llama"]), dtype=dtype, max_model_len=256, num_kv_blocks=64,
                  batch_invariant=False, speculative_config=spec)  # fmt: skip
        seen: list[torch.Tensor] = []
        original = llm.engine.model.compute_logits

        def spy(hidden: torch.Tensor, invariant: bool | None = None) -> torch.Tensor:
            logits = original(hidden, invariant)
            seen.append(logits.float().clone())
            return logits

        llm.engine.model.compute_logits = spy  # type: ignore[method-assign]
        # repeating prompts: n-gram drafts find matches, and a random model's greedy output repeats itself too
        prompts = [[5, 6, 7, 8, 9] * 4, list(range(100, 140)), [42]]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        return seen

    with_kernels = run()
    assert calls.get("paged_attention", 0) > 0 and calls.get("add_rms_norm", 0) > 0
    # rotary_ and silu_mul sit beside oneDNN's packed GEMMs, which a CPU without native bf16 cannot pack for bf16
    # (cpu_gemm.pack gives None): there the projections run through F.linear and torch's rotary and SiLU
    if cpu_gemm.pack(torch.zeros(16, 16, dtype=getattr(torch, dtype))) is not None:
        assert calls.get("rotary_", 0) > 0 and calls.get("silu_mul", 0) > 0
    monkeypatch.setenv("DSPARK_CPU_KERNELS", "0")
    cpu.lib.cache_clear()
    try:
        calls.clear()
        without = run()
        assert not calls
    finally:
        monkeypatch.delenv("DSPARK_CPU_KERNELS")
        cpu.lib.cache_clear()
    assert len(with_kernels) == len(without)
    tol = 1e-4 if dtype == "float32" else 0.06
    for a, b in zip(with_kernels, without, strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() < tol
