"""DSpark as a Drafter: owns the drafter's paged cache and turns requests into drafted blocks.

The cache has one key/value pair per draft layer, shaped like the target's and indexed by the same block tables, so
a request's drafter context lives at the same slots as its target KV (prefix-cached blocks carry both). Positions
0..num_computed-1 hold context keys written by extend_context; a block's own keys are written at anchor..anchor+K-1
while drafting and overwritten by context once those positions are accepted, which the scheduler's lookahead slots
make room for.
"""

from __future__ import annotations

import torch

from dspark.config import GREEDY_BELOW
from dspark.engine.request import Request
from dspark.models.llama import CausalLM
from dspark.spec.drafter import Proposal
from dspark.spec.dspark.markov import DraftRow, sample_block
from dspark.spec.dspark.model import DSparkModel
from dspark.worker.attention.base import AttentionBackend, AttentionContext, AttentionMetadata, KVCache, slots_for
from dspark.worker.attention.torch_ref import TorchAttention
from dspark.worker.numerics import padded_rows
from dspark.worker.transfer import download, upload, upload_tensor


class DSparkDrafter:
    method = "dspark"

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
        temps = cfg.sts_temperatures or (1.0,) * cfg.block_size
        self.inv_temperature = 1.0 / torch.tensor(temps[:num_tokens], dtype=torch.float32, device=device)
        biases = cfg.sts_biases or (0.0,) * cfg.block_size
        self.bias = torch.tensor(biases[:num_tokens], dtype=torch.float32, device=device)

    @torch.inference_mode()
    def extend_context(self, taps: torch.Tensor | None, positions: torch.Tensor, slots: torch.Tensor) -> None:
        assert taps is not None, "the target must return the tapped layers this drafter reads"
        n = taps.shape[0]
        if n == 0:
            return
        pad = padded_rows(n) - n  # batch-invariant matmuls (worker/numerics.py); padding rows are dropped
        taps = torch.cat([taps, taps.new_zeros(pad, taps.shape[1])]) if pad else taps
        self.model.write_context(self.model.context_features(taps), positions, slots, self.caches)

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> Proposal:
        cfg, bs, dev = self.model.config, self.block_size, self.device
        K, k = cfg.block_size, self.max_num_tokens
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
            rows.append(DraftRow(req.seed, req.num_output_tokens, p.temperature, p.temperature < GREEDY_BELOW))
        num_tokens = num_reqs * K
        pad = padded_rows(num_tokens) - num_tokens
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
        self.backend.prepare(meta, cfg.num_kv_heads, cfg.num_heads, bs)

        embed = self.target.model.embed_tokens
        anchor_ids = upload(anchors, torch.int64, dev)
        x = self.model.mask_input(embed).expand(num_tokens + pad, -1).clone()
        x[torch.arange(num_reqs, device=dev) * K] = embed(anchor_ids).to(x.dtype)
        pos = upload(positions + [0] * pad, torch.int64, dev)
        h = self.model.backbone(x, pos, AttentionContext(self.backend, meta, self.caches))

        # Only the first k of the K slots are drafted; rows are padded for batch-invariant matmuls.
        r_pad = padded_rows(num_reqs)
        h = h[:num_tokens].view(num_reqs, K, -1)[:, :k]
        if r_pad > num_reqs:
            h = torch.cat([h, h.new_zeros(r_pad - num_reqs, k, h.shape[-1])])
            anchor_ids = torch.cat([anchor_ids, anchor_ids.new_zeros(r_pad - num_reqs)])
        base = self.target.compute_logits(h.reshape(r_pad * k, -1)).view(r_pad, k, -1)
        drafts = sample_block(
            base, h, anchor_ids, self.model.markov_head, self.model.confidence_head, rows, self.sample
        )
        confidences = None
        if drafts.confidence_logits is not None:
            # NOTE: not torch.sigmoid, whose vectorised loop gives an element different bits by where it sits.
            scaled = drafts.confidence_logits[:num_reqs] * self.inv_temperature + self.bias
            confidences = 1 / (1 + torch.exp(-scaled))
        return Proposal(download(drafts.tokens)[0], drafts.probs, confidences)
