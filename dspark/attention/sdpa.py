"""Paged attention through torch's fused kernels: the default on CPU.

prepare() turns the step's batch into a few calls, once for all layers:

- short queries (decode, speculative verification: at most SHORT_QUERY tokens each) are batched across requests, their
  keys gathered from the paged cache block by block and padded to the longest context, with a mask for what each
  query may see;
- a long query (a prompt chunk) runs alone through scaled_dot_product_attention, causal over its own keys (is_causal
  when it is the whole context, an explicit bottom-right mask when it follows keys already cached); in bf16 on a CPU
  with AVX512-BF16, kernels/cpu.py's prefill_attention takes it instead, over the paged cache in place (1.5-1.9x torch's
  flash kernel here: 190-260 against 117-135 GFLOP/s).

torch's CPU flash kernel is slow in bf16 for short queries (it tiles for long ones: ~0.7 us per key and request, 10x
two plain matmuls at batch 16), so a short call in bf16 with enough keys runs as two batched matmuls around an fp32
softmax (`_attend_matmul`), as transformers' eager attention does.

A step of short queries only (decode, verification, a DSpark draft block) in fp32 or bf16 skips all of that where
kernels/cpu.py builds: one C kernel writes each request's keys and values and attends over its blocks in place, with
no gather, mask or padding to the longest context.

A row's bits may depend on what is batched beside it (BLAS picks kernels by shape): dspark's batch-invariant mode
uses torch_ref.TorchAttention instead (docs/numerics.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.attention.base import AttentionMetadata, KVCache
from dspark.attention.torch_ref import write_kv
from dspark.kernels import cpu as cpu_kernels

SHORT_QUERY = 16  # queries at most this long are batched across requests
# bf16 short calls with at least this many (request, key) pairs take two matmuls, not SDPA (measured crossover: SDPA
# wins at 1 request x 64 keys, the matmuls at 1 x 300 and 4 x 200); with several queries a request (verification)
# only from 4 requests on (SDPA wins at 1 x 8 queries x 300 keys, the matmuls at 16 x 4 x 130)
MATMUL_MIN_KEYS = 256


@dataclass
class _Call:
    """One attention call: its requests' query rows, key blocks and mask."""

    first_row: int  # with query_rows None: the call's queries are rows first_row.. in order, q_pad per request
    q_pad: int  # query rows per request
    query_rows: torch.Tensor | None  # [G, q_pad] token index of each (padded) query; None: contiguous (first_row)
    blocks: torch.Tensor  # [G, nb] cache blocks holding the keys (past a request's own: any block, masked)
    num_keys: int  # keys are the first num_keys slots of the blocks
    mask: torch.Tensor | None  # [G, q_pad, num_keys] bool, True where visible; None: causal over the whole context
    out_dst: torch.Tensor | None  # [n] token indices written; None: every query row, in order
    out_src: torch.Tensor | None  # [n] flat (g * q_pad + j) rows they come from
    bias: torch.Tensor | None = None  # mask as fp32 0 / -inf, made by the first layer that needs it
    prefix: int = 0  # a long causal chunk after this many cached keys, attended in two parts (_attend_chunk)
    table: torch.Tensor | None = None  # a long causal chunk's block table (int32): cpu_kernels.prefill_attention's


class SdpaAttention:
    name = "sdpa"

    def __init__(self) -> None:
        self._calls: list[_Call] | None = []
        self._meta: AttentionMetadata | None = None
        self._block_size = 0
        self._short_only = False  # every request's query is short: cpu_kernels.paged_attention takes the step

    def prepare(self, meta: AttentionMetadata, num_kv_heads: int, num_heads: int, block_size: int) -> None:
        """Plan this step; called once per step by the model runner, before the forward. A step of short queries
        has its calls built only if the kernel cannot take it (a dtype it lacks)."""
        self._meta, self._block_size = meta, block_size
        self._short_only = (
            meta.max_query_len <= SHORT_QUERY
            and meta.slot_mapping.device.type == "cpu"
            and cpu_kernels.lib() is not None
        )
        self._calls = None if self._short_only else self._plan(meta, block_size)

    def _plan(self, meta: AttentionMetadata, block_size: int) -> list[_Call]:
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        q_lens = [starts[r + 1] - starts[r] for r in range(meta.num_reqs)]
        short = [r for r in range(meta.num_reqs) if 0 < q_lens[r] <= SHORT_QUERY]
        long = [r for r in range(meta.num_reqs) if q_lens[r] > SHORT_QUERY]
        device = meta.slot_mapping.device
        tables = meta.block_tables.long()
        calls = []
        if short:
            calls.append(self._short(short, starts, lens, q_lens, tables, block_size, device, meta.causal))
        for r in long:
            call = self._long(r, starts, lens, q_lens, tables, block_size, device, meta.causal)
            if meta.causal and device.type == "cpu":  # the bf16 kernel may take it (forward knows the dtype)
                call.table = meta.block_tables[r]
            calls.append(call)
        return calls

    @staticmethod
    def _blocks(tables: torch.Tensor, reqs: list[int], num_keys: int, block_size: int) -> torch.Tensor:
        """[len(reqs), nb] the blocks holding positions 0..num_keys-1 (a table's 0-padding reads block 0, masked)."""
        nb = -(-num_keys // block_size)
        rows = tables[reqs[0] : reqs[-1] + 1] if reqs == list(range(reqs[0], reqs[-1] + 1)) else tables[reqs]
        return F.pad(rows, (0, nb - rows.shape[1])) if nb > rows.shape[1] else rows[:, :nb]

    def _short(
        self,
        reqs: list[int],
        starts: list[int],
        lens: list[int],
        q_lens: list[int],
        tables: torch.Tensor,
        block_size: int,
        device: torch.device,
        causal: bool,
    ) -> _Call:
        q_pad = max(q_lens[r] for r in reqs)
        length = max(lens[r] for r in reqs)
        # In order and all of one length (pure decode, verification of equal drafts): read q and write out as views
        contiguous = all(q_lens[r] == q_pad and starts[r] == starts[reqs[0]] + g * q_pad for g, r in enumerate(reqs))
        rows, q_pos, dst, src = [], [], [], []
        for g, r in enumerate(reqs):
            n = q_lens[r]
            rows.append(list(range(starts[r], starts[r + 1])) + [starts[r]] * (q_pad - n))
            last = list(range(lens[r] - n, lens[r])) if causal else [lens[r] - 1] * n  # not causal: every key
            q_pos.append(last + [lens[r] - 1] * (q_pad - n))
            dst += range(starts[r], starts[r + 1])
            src += range(g * q_pad, g * q_pad + n)
        qpos = torch.tensor(q_pos, device=device)  # [G, q_pad]
        kpos = torch.arange(length, device=device)
        mask = kpos[None, None, :] <= qpos[:, :, None]  # [G, q_pad, L]: causal within each context
        return _Call(
            starts[reqs[0]],
            q_pad,
            None if contiguous else torch.tensor(rows, device=device),
            self._blocks(tables, reqs, length, block_size),
            length,
            mask,
            None if contiguous else torch.tensor(dst, device=device),
            None if contiguous else torch.tensor(src, device=device),
        )

    def _long(
        self,
        r: int,
        starts: list[int],
        lens: list[int],
        q_lens: list[int],
        tables: torch.Tensor,
        block_size: int,
        device: torch.device,
        causal: bool,
    ) -> _Call:
        n, length = q_lens[r], lens[r]
        mask = None
        if not causal:  # every query sees every key of its request
            mask = torch.ones(1, n, length, dtype=torch.bool, device=device)
        elif n != length and _FLASH is not None and device.type == "cpu":  # after cached keys: see _attend_chunk
            blocks = self._blocks(tables, [r], length, block_size)
            return _Call(starts[r], n, None, blocks, length, None, None, None, prefix=length - n)
        elif n != length:  # the chunk follows keys already in the cache: query j sees keys up to length - n + j
            qpos = torch.arange(length - n, length, device=device)
            mask = (torch.arange(length, device=device)[None, :] <= qpos[:, None])[None]
        return _Call(starts[r], n, None, self._blocks(tables, [r], length, block_size), length, mask, None, None)

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
        if self._short_only and q.shape[0] == n and cache.key.dtype == q.dtype and cpu_kernels.supports(q):
            return cpu_kernels.paged_attention(
                q, k, v, cache.key, cache.value, meta.slot_mapping, meta.query_start_loc, meta.block_tables,
                meta.seq_lens, scale, meta.causal,
            )  # fmt: skip
        if self._calls is None:  # a step the kernel does not take after all
            self._calls = self._plan(meta, self._block_size)
        write_kv(cache, k[:n], v[:n], meta.slot_mapping[:n])
        first = self._calls[0] if len(self._calls) == 1 else None
        if first is not None and first.query_rows is None and first.blocks.shape[0] * first.q_pad == q.shape[0]:
            out = None  # the one call covers every row in order: its output is the step's
        else:
            out = torch.zeros_like(q)
        for call in self._calls:
            g = call.blocks.shape[0]
            if call.query_rows is None:
                qg = q[call.first_row : call.first_row + g * call.q_pad].view(g, call.q_pad, *q.shape[1:])
            else:
                qg = q[call.query_rows]  # [G, q_pad, H, D]
            if call.table is not None and cache.key.dtype == q.dtype and cpu_kernels.prefill_supported(q):
                o = cpu_kernels.prefill_attention(
                    qg[0], cache.key, cache.value, call.table, call.num_keys - call.q_pad, scale
                )[None]  # in place over the cache: no gather
                if out is None:
                    return o.reshape(q.shape)
                out[call.first_row : call.first_row + call.q_pad] = o[0]
                continue
            keys, values = _gather(cache.key, call), _gather(cache.value, call)
            if keys.dtype != q.dtype:
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            short = call.q_pad <= SHORT_QUERY and call.mask is not None and q.dtype != torch.float32
            if short and g * call.num_keys >= MATMUL_MIN_KEYS and (call.q_pad == 1 or g >= 4):
                if call.bias is None:
                    assert call.mask is not None
                    call.bias = torch.zeros(call.mask.shape, device=q.device).masked_fill_(~call.mask, float("-inf"))
                o = _attend_matmul(qg, keys, values, call.bias, scale)
            elif call.prefix:
                o = _attend_chunk(qg, keys, values, call.prefix, scale)
            else:
                o = F.scaled_dot_product_attention(
                    qg.transpose(1, 2),
                    keys.transpose(1, 2),
                    values.transpose(1, 2),
                    attn_mask=None if call.mask is None else call.mask[:, None],
                    is_causal=call.mask is None,
                    scale=scale,
                    enable_gqa=True,
                ).transpose(1, 2)  # [G, q_pad, H, D]
            if out is None:
                return o.reshape(q.shape)
            if call.out_dst is None:
                out[call.first_row : call.first_row + o.shape[0] * o.shape[1]] = o.reshape(-1, *q.shape[1:])
            else:
                out.index_copy_(0, call.out_dst, o.reshape(-1, *q.shape[1:])[call.out_src])
        assert out is not None
        return out


# torch's CPU flash kernel with its log-sum-exp, to merge two attention calls exactly (private: if absent, chunks take
# one SDPA call with a mask)
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_chunk(
    q: torch.Tensor,  # [1, n, H, D]: a prompt chunk
    k: torch.Tensor,  # [1, prefix + n, Hkv, D]: the cached keys, then the chunk's own
    v: torch.Tensor,
    prefix: int,
    scale: float,
) -> torch.Tensor:  # [1, n, H, D]
    """A chunk's causal attention as two flash calls merged by their log-sum-exps: every cached key (no mask), then
    the chunk's own keys (is_causal). One call with an explicit bottom-right mask reads the mask and computes every
    masked block: at 8,000 tokens in 2,048-token chunks the first token came in 23.2 s against 29.5 s (bf16, 2
    vCPU), about the cost of one unchunked call."""
    assert _FLASH is not None
    size = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)  # [1, H, n, D]
    kt = k.transpose(1, 2).repeat_interleave(size, dim=1)  # the flash kernel takes no GQA
    vt = v.transpose(1, 2).repeat_interleave(size, dim=1)
    o_past, lse_past = _FLASH(qt, kt[:, :, :prefix], vt[:, :, :prefix], scale=scale)[:2]
    o_own, lse_own = _FLASH(qt, kt[:, :, prefix:], vt[:, :, prefix:], is_causal=True, scale=scale)[:2]
    lse = torch.logaddexp(lse_past, lse_own)[..., None]  # [1, H, n, 1]
    o = o_past.float() * (lse_past[..., None] - lse).exp() + o_own.float() * (lse_own[..., None] - lse).exp()
    return o.to(q.dtype).transpose(1, 2)


def _gather(cache: torch.Tensor, call: _Call) -> torch.Tensor:
    """[G, L, Hkv, D] the call's keys (or values): whole blocks gathered with one index each (index_select on the
    block dimension is ~5x faster than advanced indexing here), then cut to the context."""
    g, nb = call.blocks.shape
    rows = cache.index_select(0, call.blocks.flatten())
    return rows.view(g, nb * cache.shape[1], *cache.shape[2:])[:, : call.num_keys]


def _attend_matmul(
    q: torch.Tensor,  # [G, Lq, H, D]
    k: torch.Tensor,  # [G, L, Hkv, D]
    v: torch.Tensor,
    bias: torch.Tensor,  # [G, Lq, L] fp32, 0 where visible and -inf where not
    scale: float,
) -> torch.Tensor:  # [G, Lq, H, D]
    """Attention as two batched matmuls around an fp32 softmax; the query heads sharing a kv head are rows of one
    matmul (no key copies for GQA)."""
    g, lq, h, d = q.shape
    hkv, length = k.shape[2], k.shape[1]
    size = h // hkv
    q = q * scale  # before the matmul: a smaller tensor than the scores (and exact for power-of-two scales)
    if lq == 1:  # decode: keys as the matmul's left side read them in their cached layout (~2x faster)
        qh = q.view(g, hkv, size, d).transpose(-1, -2)  # [G, Hkv, D, size]
        scores = torch.matmul(k.transpose(1, 2), qh).transpose(-1, -2).float()  # [G, Hkv, size, L]
    else:
        qh = q.view(g, lq, hkv, size, d).permute(0, 2, 1, 3, 4).reshape(g, hkv, lq * size, d)
        scores = torch.matmul(qh, k.permute(0, 2, 3, 1)).float()
    scores = scores.view(g, hkv, lq, size, length).add_(bias[:, None, :, None, :])
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(g, hkv, lq * size, length)
    o = torch.matmul(probs, v.transpose(1, 2))  # [G, Hkv, Lq * size, D]
    return o.view(g, hkv, lq, size, d).permute(0, 2, 1, 3, 4).reshape(g, lq, h, d)
