"""Paged attention in Triton for one flattened varlen batch (prefill chunks, decodes and verifications together),
safe to capture in a CUDA graph. Same semantics as the torch reference (torch_ref.py), not its bits.

Graph-safety contract. prepare() and forward() read only:

- tensor shapes (num_tokens = slot_mapping.shape[0], num_reqs = seq_lens.shape[0], the cache's shape);
- the device tensors meta.slot_mapping, meta.query_start_loc, meta.seq_lens and meta.block_tables, whose contents may
  change between replays (their addresses may not: they are the graph's static inputs);
- meta.max_query_len and meta.max_seq_len, as UPPER BOUNDS only (they pick tile sizes and the number of key splits;
  a graph passes the longest query it was captured for and max_model_len);
- meta.causal.

They never read meta.num_actual_tokens, meta.query_start_loc_cpu or meta.seq_lens_cpu (stale at replay), never copy a
device value to the host, and allocate only tensors whose sizes follow from the above. prepare() allocates this step's
program plan and split scratch; a CUDA graph must capture prepare() together with the forwards that use it (the
graph's pool then keeps them), as worker/cuda_graphs.py does.

Padding: tokens past query_start_loc[num_reqs] are padding: slot -1 (nothing is written to the cache) and zero
output rows. A request slot may be empty (query_start_loc[r] == query_start_loc[r + 1], seq_lens[r] == 0): it gets no
program and writes nothing.

Plan. A program owns one query block (up to block_m query tokens of one request) for one kv head and one key split.
Request r has cdiv(q_len_r, block_m) blocks; prepare() turns their prefix sum into plan[0][p] = request of program p
and plan[1][p] = block index within it, with torch ops on the device (a searchsorted, no host read). The grid is the
upper bound cdiv(num_tokens, block_m) + num_reqs on the number of blocks (each request wastes less than one block);
surplus programs get request num_reqs and zero the padding rows.
"""

from __future__ import annotations

import functools

import torch
import triton

from dspark.attention.base import AttentionMetadata, KVCache
from dspark.attention.triton_kernels import paged_attention, write_kv

MAX_ROWS = 64  # (query token, head) rows per program: 64 x head_dim fp32 accumulators stay in registers
# Splits: enough programs to fill every SM when a decode or verification batch alone cannot, but no split so short
# that its partial costs more than it saves (tuned with benchmarks/gpu/bench_attention.py).
PROGRAMS_PER_SM = 4
MAX_SPLITS = 32
MIN_KEYS_PER_SPLIT = 128


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the Triton interpreter (CPU tests): parallelism is irrelevant
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Key splits per query block: about PROGRAMS_PER_SM programs per SM, no split under MIN_KEYS_PER_SPLIT keys.

    A power of two, so a server sees at most six compiled variants. max_seq_len is an upper bound (a CUDA graph passes
    max_model_len): splits past a request's own keys exit at once, so over-splitting a short context is cheap.
    """
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(num_programs, 1))
    cap = min(MAX_SPLITS, max(1, max_seq_len // MIN_KEYS_PER_SPLIT), want)
    return 1 << (cap.bit_length() - 1)  # the largest power of two <= cap


def tile_config(rows: int, head_dim: int) -> tuple[int, int]:
    """(keys per tile, warps) for a program of `rows` rows.

    Small programs (decode, verification: 16 or 32 rows) of head_dim <= 64 ran faster on 128-key tiles with 2 warps
    (tuned with benchmarks/gpu/bench_attention.py, for head_dim 64 only). Larger rows or head_dim keep 64 keys on 4
    warps, so the [rows, BLOCK_N] scores and [rows, head_dim] accumulator stay in registers.
    """
    if rows <= 32 and head_dim <= 64:
        return 128, 2
    return 64, 4


class TritonAttention:
    name = "triton"

    def __init__(self, num_splits: int | None = None, invariant: bool = False) -> None:
        """num_splits: force the number of key splits (tests, benchmarks); None chooses it from the launch shape.

        invariant: a query row's bits never depend on the step around it (the engine's batch_invariant mode). The
        tile shape, the key splits and which tiles skip the mask are what vary with the step: here rows per program,
        keys per tile and warps are fixed, keys are not split, and every tile is masked. A row then walks its keys
        in tiles aligned at multiples of BLOCK_N from 0, whether it is decoded alone, verified with drafts or batched
        with others: keys past its position add exact zeros, so the same products are summed in the same order. The
        cost: no split-KV (a small batch with long contexts leaves SMs idle), 16-row programs for prompt chunks too,
        and a mask on every tile."""
        self._force_splits = num_splits
        self.invariant = invariant
        self._meta: AttentionMetadata | None = None
        self._plan = torch.empty(2, 0, dtype=torch.int32)
        self._partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._block_m = self._rows = self._num_splits = self._block_size = 1

    @property
    def num_splits(self) -> int:
        """Key splits of the prepared step (reported by the benchmark)."""
        return self._num_splits

    def prepare(self, meta: AttentionMetadata, num_kv_heads: int, num_heads: int, block_size: int) -> None:
        """This step's program plan (device ops only); shared by every layer's forward."""
        assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        device = meta.query_start_loc.device
        num_tokens = meta.slot_mapping.shape[0]
        num_reqs = meta.seq_lens.shape[0]
        group = num_heads // num_kv_heads
        # Rows are (token, head-in-group) pairs: a decode of SmolLM2 (group 3) fills 3 of 16 rows, a verification of
        # 8 tokens 24 of 32; longer queries take MAX_ROWS // group tokens per block.
        rows = triton.next_power_of_2(max(16, min(meta.max_query_len * group, MAX_ROWS), group))
        if self.invariant:
            rows = triton.next_power_of_2(max(16, group))
        self._rows, self._block_m = rows, rows // group
        num_programs = triton.cdiv(num_tokens, self._block_m) + num_reqs

        qsl = meta.query_start_loc
        blocks = torch.div(qsl[1:] - qsl[:-1] + (self._block_m - 1), self._block_m, rounding_mode="floor")
        first_block = torch.zeros(num_reqs + 1, dtype=torch.int32, device=device)
        torch.cumsum(blocks, 0, dtype=torch.int32, out=first_block[1:])
        program = torch.arange(num_programs, dtype=torch.int32, device=device)
        # Request of program p: the number of requests whose blocks all end at or before p. Empty requests (no blocks)
        # are skipped over; p past the last block gets num_reqs.
        req = torch.searchsorted(first_block[1:], program, right=True, out_int32=True)
        self._plan = torch.stack([req, program - first_block.index_select(0, req)])

        busy = max(num_reqs, triton.cdiv(num_tokens, self._block_m)) * num_kv_heads  # programs with real work
        if self.invariant:
            self._num_splits = 1
        elif self._force_splits is not None:
            self._num_splits = self._force_splits
        else:
            self._num_splits = choose_num_splits(busy, meta.max_seq_len, _num_sms(device))
        self._partials = None
        self._block_size = block_size
        self._meta = meta

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotary already applied
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        assert meta is self._meta, "prepare() must be called with this step's metadata"
        assert cache.key.shape[1] == self._block_size, (
            f"cache blocks of {cache.key.shape[1]}, prepared for {self._block_size}"
        )
        write_kv(cache.key, cache.value, k, v, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        shape = (num_tokens, num_heads, self._num_splits)
        if self._num_splits > 1 and (self._partials is None or self._partials[2].shape != (*shape, head_dim)):
            # Once per step, at the first layer (head_dim is known only here); the other layers reuse it.
            self._partials = (
                torch.empty(shape, dtype=torch.float32, device=q.device),
                torch.empty(shape, dtype=torch.float32, device=q.device),
                torch.empty((*shape, head_dim), dtype=torch.float32, device=q.device),
            )
        block_n, num_warps = tile_config(self._rows, head_dim)
        paged_attention(
            q,
            cache.key,
            cache.value,
            out,
            self._plan,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            self._partials,
            scale,
            causal=meta.causal,
            block_m=self._block_m,
            rows=self._rows,
            block_n=block_n,
            num_splits=self._num_splits,
            num_warps=num_warps,
            all_masked=self.invariant,
        )
        return out
