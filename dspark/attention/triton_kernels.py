"""Triton kernels of the paged-attention backend, with thin launchers that check shapes and strides.

Three kernels, each with a torch twin in torch_ref.py (write_kv, and TorchAttention for the two attention kernels):

- write_kv: one program per token scatters its keys and values to cache slot slot_mapping[t]; slot -1 writes nothing.
- attention: one launch for a flattened batch of prefill chunks, decodes and verifications. A program owns a query
  block (up to BLOCK_M consecutive query tokens of one request) times the GROUP query heads that share one kv head:
  those BLOCK_M * GROUP (token, head) pairs are the rows of its matmuls (padded to a power of two >= 16, the smallest
  tensor-core tile), so each key and value tile is read once for the whole group (GQA without copying keys). The
  key range is walked in tiles of BLOCK_N keys gathered through the block table, with an online softmax in fp32
  (base 2: the scale carries log2(e)). With NUM_SPLITS > 1 each program covers 1/NUM_SPLITS of its keys and writes
  an unnormalised partial (m, l, acc) instead of the output.
- combine: merges the partials of the splits into the output.

Nothing here reads the host's view of the batch: programs map to requests through a device array built by the
backend's prepare(), every grid depends on tensor shapes only, and surplus programs exit (or zero padding rows), so
the kernels can be captured once in a CUDA graph and replayed with other sequence lengths.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# NOTE: finite, not -inf: a row that sees no key in a tile (or a whole split) keeps m = NEG_INF and l = 0, and
# exp2(NEG_INF - m) is an exact 0 or 1 instead of the NaN of (-inf) - (-inf).
NEG_INF = tl.constexpr(-1.0e30)


@triton.jit(do_not_specialize=["num_tokens"])
def _write_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64, -1: padding
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    h = tl.arange(0, KV_HEADS_PAD)
    d = tl.arange(0, HEAD_DIM)
    # Padding (slot -1) is masked out of the loads and stores rather than branched around: it only loads its slot.
    mask = (slot >= 0) & (h[:, None] < NUM_KV_HEADS)
    block = tl.where(slot >= 0, slot, 0) // BLOCK_SIZE
    dst = block * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(
    q,  # [ROWS, HEAD_DIM] in the cache dtype
    m_i,  # [ROWS] fp32 running max (base 2)
    l_i,  # [ROWS] fp32 running sum
    acc,  # [ROWS, HEAD_DIM] fp32 running numerator
    key_cache_ptr,
    value_cache_ptr,
    table_ptr,  # this request's block-table row
    start,  # first key position of the tile
    kv_end,  # keys at or past this are never loaded
    q_pos,  # [ROWS] last key position each row sees
    kv_head_off,
    stride_cb,
    stride_cs,
    qk_scale,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    kpos = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    in_range = kpos < kv_end
    if MASKED:
        block = tl.load(table_ptr + kpos // BLOCK_SIZE, mask=in_range, other=0)
    else:
        block = tl.load(table_ptr + kpos // BLOCK_SIZE)
    # int64: block * stride_cb overflows int32 for caches past 2^31 elements.
    off = block.to(tl.int64) * stride_cb + (kpos % BLOCK_SIZE) * stride_cs + kv_head_off
    if MASKED:
        k = tl.load(key_cache_ptr + off[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(value_cache_ptr + off[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(key_cache_ptr + off[:, None] + d[None, :])
        v = tl.load(value_cache_ptr + off[:, None] + d[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [ROWS, BLOCK_N]
    if MASKED:
        s = tl.where((kpos[None, :] <= q_pos[:, None]) & in_range[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "plan_stride", "stride_bt"])
def _attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    out_ptr,  # [num_tokens, num_heads, head_dim]: written when NUM_SPLITS == 1
    part_m_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32: written when NUM_SPLITS > 1
    part_l_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] fp32
    plan_ptr,  # [2, plan_stride] int32: request of each program (num_reqs: surplus), query block within it
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    num_tokens,
    num_reqs,
    plan_stride,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    qk_scale,  # softmax scale * log2(e)
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens per program; BLOCK_M * GROUP <= ROWS
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ALL_MASKED: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(plan_ptr + pid)
    q_block = tl.load(plan_ptr + plan_stride + pid)
    rows = tl.arange(0, ROWS)
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + rows % GROUP
    in_block = rows < BLOCK_M * GROUP

    if req >= num_reqs:
        # Surplus program: the grid is an upper bound on the number of query blocks. Its spare blocks cover the
        # padding tokens past the last request, which get zeros (finite rows for the layers after attention); with
        # splits the combine kernel writes them instead.
        if NUM_SPLITS == 1:
            tok = tl.load(query_start_loc_ptr + num_reqs) + q_block * BLOCK_M + rows // GROUP
            pad = in_block & (tok < num_tokens)
            dst = out_ptr + tok[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
            tl.store(dst, tl.zeros([ROWS, HEAD_DIM], dtype=out_ptr.dtype.element_ty), mask=pad[:, None])
        return

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    j = q_block * BLOCK_M + rows // GROUP  # query index within the request
    valid = in_block & (j < q_len)
    tok = (q_start + j).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=valid[:, None], other=0.0
    )

    first_q = seq_len - q_len + q_block * BLOCK_M  # position of the block's first query
    if CAUSAL:
        q_pos = seq_len - q_len + j
        kv_end = tl.minimum(seq_len, first_q + BLOCK_M)
        shared_end = first_q + 1  # keys before this are visible to every row of the block
    else:
        q_pos = tl.zeros([ROWS], dtype=tl.int32) + seq_len - 1
        kv_end = seq_len
        shared_end = seq_len

    # This split's share of the block's key tiles; a split past the end gets lo >= hi and writes a neutral partial.
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, kv_end)
    # Whole tiles below shared_end need no mask; only the tail (causal diagonal, last partial tile) pays for one.
    # ALL_MASKED (batch-invariant mode): every tile takes the masked path. Which tiles a row sees unmasked depends on
    # its query block's first position, and the two paths may round differently (the unmasked one lets the compiler
    # fuse the scale into exp2's argument, an FMA), so the same key tile could give a row other bits decoded alone
    # than verified with drafts.
    if ALL_MASKED:
        mid = lo
    else:
        mid = tl.maximum(lo, tl.minimum(hi, (shared_end // BLOCK_N) * BLOCK_N))

    table_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    kv_head_off = kv_head * stride_ch
    m_i = tl.zeros([ROWS], dtype=tl.float32) + NEG_INF
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for start in range(lo, mid, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, key_cache_ptr, value_cache_ptr, table_ptr, start, kv_end, q_pos, kv_head_off,
            stride_cb, stride_cs, qk_scale, BLOCK_N, BLOCK_SIZE, HEAD_DIM, False, DOT_PRECISION,
        )  # fmt: skip
    for start in range(mid, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, key_cache_ptr, value_cache_ptr, table_ptr, start, kv_end, q_pos, kv_head_off,
            stride_cb, stride_cs, qk_scale, BLOCK_N, BLOCK_SIZE, HEAD_DIM, True, DOT_PRECISION,
        )  # fmt: skip

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # a row with no key (empty context) gives zeros
        dst = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=valid[:, None])
    else:
        part = (tok * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=valid)
        tl.store(part_l_ptr + part, l_i, mask=valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=valid[:, None])


@triton.jit(do_not_specialize=["num_reqs"])
def _combine_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_m_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    part_l_ptr,
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] fp32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    num_reqs,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    dst = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d
    if t >= tl.load(query_start_loc_ptr + num_reqs):  # padding token: its partials were never written
        tl.store(dst, tl.zeros([HEAD_DIM], dtype=out_ptr.dtype.element_ty))
        return
    s = tl.arange(0, SPLITS_PAD)
    part = (t.to(tl.int64) * NUM_HEADS + h) * NUM_SPLITS + s
    in_range = s < NUM_SPLITS
    m = tl.load(part_m_ptr + part, mask=in_range, other=NEG_INF)
    l_s = tl.load(part_l_ptr + part, mask=in_range, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=in_range[:, None], other=0.0)
    # Rescale every split to the common max; empty splits (m = NEG_INF, l = 0) add exact zeros.
    w = tl.exp2(m - tl.max(m, 0))
    denom = tl.sum(w * l_s, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(dst, out.to(out_ptr.dtype.element_ty))


def write_kv(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1: padding (nothing written)
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    _check_cache(key_cache, value_cache, num_kv_heads, head_dim)
    assert v.shape == k.shape, f"v {tuple(v.shape)} != k {tuple(k.shape)}"
    assert k.stride(2) == 1 and v.stride(2) == 1, "k and v need a contiguous head_dim"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)}, want ({num_tokens},)"
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        num_warps=1 if num_kv_heads * head_dim <= 256 else 4,
    )


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written in full (padding rows: zeros)
    plan: torch.Tensor,  # [2, num_programs] int32 from the backend's prepare()
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # (m, l, acc) scratch, needed if splits > 1
    scale: float,
    *,
    causal: bool,
    block_m: int,
    rows: int,
    block_n: int,
    num_splits: int,
    num_warps: int = 4,
    num_stages: int = 2,
    all_masked: bool = False,  # every key tile through the masked path (batch-invariant mode)
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    num_reqs = seq_lens.shape[0]
    _check_cache(key_cache, value_cache, num_kv_heads, head_dim)
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    group = num_heads // num_kv_heads
    assert q.dtype == key_cache.dtype, f"q is {q.dtype}, the cache {key_cache.dtype}"
    assert out.shape == q.shape and out.stride(2) == 1 and q.stride(2) == 1, "q and out need a contiguous head_dim"
    assert block_m * group <= rows and rows >= 16 and rows & (rows - 1) == 0, (block_m, group, rows)
    assert query_start_loc.shape == (num_reqs + 1,) and block_tables.shape[0] == num_reqs
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert plan.dtype == torch.int32 and plan.shape[0] == 2 and plan.stride(1) == 1
    if num_tokens == 0:
        return
    if num_splits > 1:
        assert partials is not None, "num_splits > 1 needs the partials scratch"
        part_m, part_l, part_acc = partials
        assert part_acc.shape == (num_tokens, num_heads, num_splits, head_dim) and part_acc.is_contiguous()
        assert part_m.shape == part_l.shape == part_acc.shape[:3]
    else:
        part_m = part_l = part_acc = out  # never touched: the kernel's NUM_SPLITS == 1 path writes `out`
    _attention_kernel[(plan.shape[1], num_kv_heads, num_splits)](
        q,
        key_cache,
        value_cache,
        out,
        part_m,
        part_l,
        part_acc,
        plan,
        query_start_loc,
        seq_lens,
        block_tables,
        num_tokens,
        num_reqs,
        plan.stride(0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        scale * math.log2(math.e),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        ROWS=rows,
        BLOCK_N=block_n,
        BLOCK_SIZE=key_cache.shape[1],
        NUM_SPLITS=num_splits,
        CAUSAL=causal,
        # NOTE: fp32 stays fp32 (no TF32): the fp32 engine is compared with the torch reference token for token.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        ALL_MASKED=all_masked,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _combine_kernel[(num_tokens, num_heads)](
            out,
            part_m,
            part_l,
            part_acc,
            query_start_loc,
            num_reqs,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=1 if head_dim <= 64 else 2,
        )


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    assert key_cache.dim() == 4 and key_cache.shape[2:] == (num_kv_heads, head_dim), (
        f"cache {tuple(key_cache.shape)}, want [num_blocks, block_size, {num_kv_heads}, {head_dim}]"
    )
    assert value_cache.shape == key_cache.shape and value_cache.stride() == key_cache.stride(), (
        "key and value caches need the same shape and strides"
    )
    assert key_cache.stride(3) == 1, "the cache needs a contiguous head_dim"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim}: a power of two >= 16 is needed"
