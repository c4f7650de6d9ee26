"""DSpark as a Drafter: owns the drafter's paged cache and turns requests into drafted blocks.

The cache has one key/value pair per draft layer, shaped like the target's and indexed by the same block tables, so
a request's drafter context lives at the same slots as its target KV (prefix-cached blocks carry both). Positions
0..num_computed-1 hold context keys written by extend_context; a block's own keys are written at anchor..anchor+K-1
while drafting and overwritten by context once those positions are accepted, which the scheduler's lookahead slots
make room for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dspark.attention.base import AttentionBackend, AttentionContext, AttentionMetadata, KVCache, slots_for
from dspark.attention.torch_ref import TorchAttention
from dspark.core.request import Request
from dspark.models.llama import CausalLM
from dspark.speculative.drafters.base import Proposal
from dspark.speculative.drafters.dspark.markov import DraftRow, draw_inputs, sample_block_with
from dspark.speculative.drafters.dspark.model import DSparkModel
from dspark.utils.numerics import rows_for
from dspark.utils.transfer import Download, upload, upload_tensor

if TYPE_CHECKING:
    from dspark.speculative.drafters.dspark.graphs import DraftGraphs


class DSparkDrafter:
    method = "dspark"
    # Rows padded for batch-invariant matmuls (utils/numerics.py): on CUDA (its graphs' shapes) and in batch-invariant
    # mode; the engine sets it.
    pad_rows = True
    # The fast CPU path defers the context write (the engine sets it; see extend_context).
    defer_context = False
    DEFER_ROWS = 64  # rows held back before they are written anyway

    def __init__(
        self,
        model: DSparkModel,
        target: CausalLM,
        num_tokens: int,
        sample: bool,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        backend: AttentionBackend | None = None,  # None: the torch reference
    ) -> None:
        cfg = model.config
        self.model = model
        self.target = target
        self.max_num_tokens = num_tokens
        self.num_lookahead_tokens = cfg.block_size
        self.tap_layers = cfg.target_layer_ids
        self.sample = sample
        self.block_size = block_size
        self.device = device
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [
            KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]
        self.backend = backend if backend is not None else TorchAttention()
        # The calibration's fits ([E] sampling temperatures; [E, k] logit scales 1/T and shifts), interpolated per
        # request on the device (StsTable.at's arithmetic) so that a captured drafting pass reads no host value.
        points, inv, bias = cfg.sts_table.scales()
        self.sts_range = (float(points[0]), float(points[-1]))
        self.sts_points = torch.tensor(points, dtype=torch.float32, device=device)
        self.inv_temperature = torch.tensor(inv[:, :num_tokens], dtype=torch.float32, device=device)
        self.bias = torch.tensor(bias[:, :num_tokens], dtype=torch.float32, device=device)
        self.graphs: DraftGraphs | None = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # deferred context rows
        self._pending_rows = 0

    @torch.inference_mode()
    def extend_context(self, taps: torch.Tensor | None, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the drafter's context of the rows the target kept.

        With defer_context the rows are held back and written in one pass when drafting next reads the cache
        (propose), when a request is released (its blocks may be reused, or stay in the prefix cache for another
        request's drafts), or once DEFER_ROWS are held. On CPU the write's cost is mostly its ops' fixed overhead, not
        their arithmetic: on the 2-vCPU machine (bf16, the shipped drafter, one thread) ~0.25 ms for 1 row, ~1.2 ms
        for 64 (benchmarks/cpu_step_parts.py; up to twice that with another process on the machine). Written at once
        it was paid in every plain step of a request that adaptive verification keeps from drafting."""
        assert taps is not None, "the target must return the tapped layers this drafter reads"
        n = taps.shape[0]
        if n == 0:
            return
        if self.defer_context and (self._pending or n < self.DEFER_ROWS):
            # Copies: the step's tensors are not the drafter's to keep.
            self._pending.append((taps.clone(), positions.clone(), slots.clone()))
            self._pending_rows += n
            if self._pending_rows >= self.DEFER_ROWS:
                self.flush_context()
            return
        self._write_context(taps, positions, slots)

    @torch.inference_mode()
    def flush_context(self) -> None:
        """Write every deferred context row, in the order the steps produced them (a slot written twice, as the
        rows of a rejected draft are, keeps the later one)."""
        if not self._pending:
            return
        pending, self._pending, self._pending_rows = self._pending, [], 0
        if len(pending) == 1:
            self._write_context(*pending[0])
            return
        taps, positions, slots = (torch.cat(parts) for parts in zip(*pending, strict=True))
        # A slot held twice (a rejected draft's row, then the accepted token's): index_copy_ may write duplicates in
        # any order (threads split the rows), so only each slot's last row goes.
        unique, inverse = torch.unique(slots, return_inverse=True)
        if unique.shape[0] < slots.shape[0]:
            order = torch.arange(slots.shape[0])
            last = torch.full_like(unique, -1).scatter_reduce_(0, inverse, order, "amax")
            taps, positions, slots = taps[last], positions[last], slots[last]
        self._write_context(taps, positions, slots)

    def _write_context(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        n = taps.shape[0]
        pad = rows_for(n, self.pad_rows) - n  # batch-invariant matmuls (utils/numerics.py); padding rows are dropped
        taps = torch.cat([taps, taps.new_zeros(pad, taps.shape[1])]) if pad else taps
        self.model.write_context(self.model.context_features(taps), positions, slots, self.caches)

    def write_context_all(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """extend_context for every row of a captured target step (padding rows have slot -1 and write nothing).

        Rows of rejected drafts are written too: they sit at positions from the next anchor on, which the next block
        overwrites with its own keys before anything reads them, and the target's extend overwrites after that (the
        same reasoning as the target's own KV of rejected drafts)."""
        self.model.write_context(self.model.context_features(taps), positions, slots, self.caches, skip_padding=True)

    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the drafting pass in CUDA graphs (worker/cuda_graphs.py explains why), for up to max_num_seqs."""
        from dspark.speculative.drafters.dspark.graphs import DraftGraphs

        self.graphs = DraftGraphs(self, max_num_seqs, max_model_len)
        self.graphs.capture()

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> Proposal:
        self.flush_context()  # the block attends to the context
        cfg, bs, dev = self.model.config, self.block_size, self.device
        K = cfg.block_size
        num_reqs = len(requests)
        anchors, positions, slots, seq_lens, tables, rows = [], [], [], [], [], []
        for req in requests:
            anchor_pos = req.num_tokens - 1
            assert req.num_computed_tokens == anchor_pos, "the target must have computed every token but the anchor"
            anchors.append(req.all_token_ids[-1])
            positions += range(anchor_pos, anchor_pos + K)
            slots += slots_for(req.block_ids, anchor_pos, anchor_pos + K, bs)
            seq_lens.append(anchor_pos + K)
            tables.append(req.block_ids)
            p = req.sampling_params
            rows.append(DraftRow(req.seed, req.num_output_tokens, p.temperature, p.greedy))
        # A pass whose rows are all greedy draws argmaxes only: no softmax, no inverse CDF (an fp64 scan of the
        # vocabulary per draft) and no [R, k, vocab] distributions to copy out. Greedy rows are verified by argmax and
        # never read them.
        sample = self.sample and not all(row.greedy for row in rows)
        key = self.graphs.pick(num_reqs) if self.graphs is not None else None
        if key is not None:
            assert self.graphs is not None
            tokens, probs, confidences = self.graphs.replay(
                key, anchors, positions, slots, seq_lens, tables, rows, sample
            )
            return Proposal(Download(tokens), probs, confidences)

        num_tokens = num_reqs * K
        pad = rows_for(num_tokens, self.pad_rows) - num_tokens
        max_blocks = max(len(t) for t in tables)
        meta = AttentionMetadata(
            num_actual_tokens=num_tokens,
            slot_mapping=upload(slots + [-1] * pad, torch.int64, dev),
            query_start_loc=torch.arange(0, num_tokens + 1, K, dtype=torch.int32, device=dev),
            seq_lens=upload(seq_lens, torch.int32, dev),
            block_tables=upload_tensor(
                torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32), dev
            ),
            query_start_loc_cpu=list(range(0, num_tokens + 1, K)),
            seq_lens_cpu=seq_lens,
            max_query_len=K,
            max_seq_len=max(seq_lens),
            causal=False,
        )
        temps, greedy, u_all = draw_inputs(rows, self.max_num_tokens, sample, dev)
        anchor_ids = upload(anchors, torch.int64, dev)
        pos = upload(positions + [0] * pad, torch.int64, dev)
        tokens, probs, confidences = self.block(self.backend, meta, anchor_ids, pos, temps, greedy, u_all)
        return Proposal(Download(tokens), probs, confidences)

    def scaling(self, temps: torch.Tensor, greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The calibration of each request's confidences ([R] softmax temperatures and greedy flags): logit scales
        and shifts, [k] when one fit serves every temperature, else [R, k] interpolated at its temperature."""
        if self.sts_points.shape[0] == 1:
            return self.inv_temperature[0], self.bias[0]
        t = torch.where(greedy, 0.0, temps).clamp(*self.sts_range)
        hi = torch.searchsorted(self.sts_points, t, right=True).clamp(1, self.sts_points.shape[0] - 1)
        lo = hi - 1
        w = ((t - self.sts_points[lo]) / (self.sts_points[hi] - self.sts_points[lo]))[:, None]
        inv, bias = self.inv_temperature, self.bias
        # lerp is exact at w = 0 and 1: a request at a fitted temperature gets that fit's very values.
        return torch.lerp(inv[lo], inv[hi], w), torch.lerp(bias[lo], bias[hi], w)

    def block(
        self,
        backend: AttentionBackend,
        meta: AttentionMetadata,  # non-causal, K query tokens per request
        anchor_ids: torch.Tensor,  # [R]
        pos: torch.Tensor,  # [R * K (+ padding)]
        temps: torch.Tensor,  # [R]
        greedy: torch.Tensor,  # [R]
        u_all: torch.Tensor | None,  # [R, k]; None: argmax drafts
        probs_out: torch.Tensor | None = None,  # [k, R, vocab]: where sampled drafts' distributions go
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The drafting pass on device inputs (eager, or captured by DraftGraphs): (tokens [R, k], the
        distributions they were drawn from [R, k, vocab] or None (None too when written to probs_out), calibrated
        confidences [R, k] or None)."""
        cfg = self.model.config
        K, k = cfg.block_size, self.max_num_tokens
        num_reqs = anchor_ids.shape[0]
        backend.prepare(meta, cfg.num_kv_heads, cfg.num_heads, self.block_size)
        embed = self.target.model.embed_tokens
        x = self.model.mask_input(embed).expand(pos.shape[0], -1).clone()
        x[torch.arange(num_reqs, device=pos.device) * K] = embed(anchor_ids).to(x.dtype)
        h = self.model.backbone(x, pos, AttentionContext(backend, meta, self.caches))

        # Only the first k of the K slots are drafted; rows are padded for batch-invariant matmuls.
        r_pad = rows_for(num_reqs, self.pad_rows)
        h = h[: num_reqs * K].view(num_reqs, K, -1)[:, :k]
        if r_pad > num_reqs:
            h = torch.cat([h, h.new_zeros(r_pad - num_reqs, k, h.shape[-1])])
            anchor_ids = torch.cat([anchor_ids, anchor_ids.new_zeros(r_pad - num_reqs)])
        base = self.target.draft_logits(h.reshape(r_pad * k, -1)).view(r_pad, k, -1)
        model = self.model
        drafts = sample_block_with(
            base, h, anchor_ids, model.markov_head, model.confidence_head, temps, greedy, u_all, probs_out
        )
        confidences = None
        if drafts.confidence_logits is not None:
            # NOTE: not torch.sigmoid, whose vectorised loop gives an element different bits by where it sits.
            inv, bias = self.scaling(temps[:num_reqs], greedy[:num_reqs])
            scaled = drafts.confidence_logits[:num_reqs] * inv + bias
            confidences = 1 / (1 + torch.exp(-scaled))
        return drafts.tokens[:num_reqs], drafts.probs, confidences
