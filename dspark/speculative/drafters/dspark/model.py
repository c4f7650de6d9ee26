"""The DSpark drafter's weights and forward passes (names as DeepSpec's checkpoints).

- Context: the target's tapped hidden states [n, n_taps * H] -> `fc` -> `hidden_norm`. Each draft layer turns these
  features into keys and values with its own k_proj / v_proj (k_norm and RoPE on the keys, at the tokens'
  positions) and keeps them in the drafter's paged cache, which shares the target's block tables.
- Block: [anchor, mask x (K-1)] at positions anchor..anchor+K-1, through N Qwen3-style layers that attend to the
  cached context (strictly before the anchor) and bidirectionally within the block, then `norm`.
- The target's embedding and lm_head are used, frozen and never stored again: they are passed in, not owned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.attention.base import AttentionContext, KVCache
from dspark.attention.torch_ref import write_kv
from dspark.kernels import cpu as cpu_kernels
from dspark.models import cpu_gemm, fused_ops
from dspark.models.llama import Attention, DecoderLayer, RMSNorm, Rotary, apply_rotary
from dspark.speculative.drafters.dspark.confidence import ConfidenceHead
from dspark.speculative.drafters.dspark.config import DSparkConfig
from dspark.speculative.drafters.dspark.markov import MarkovHead


class DSparkModel(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.config = cfg
        lc = cfg.layer_config
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(lc, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank) if cfg.markov_rank else None
        self.confidence_head = ConfidenceHead(cfg.hidden_size, cfg.markov_rank) if cfg.confidence_head else None
        if cfg.mask_token_id is None:
            self.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        # A block reaches K-1 positions past the last token the target may see.
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings + cfg.block_size)
        self.context_kv_weight: torch.Tensor | None = None  # fuse_context_weights
        self.fc_packed: torch.Tensor | None = None  # pack_for_cpu
        self.context_kv_packed: torch.Tensor | None = None

    def fuse_context_weights(self) -> None:
        """One GEMM for every draft layer's context keys and values (the CUDA path of write_context).

        The context write runs in every target step of an engine with this drafter, drafting or not, and at a
        batch of one its cost is its kernel count: 5 per layer unfused (k_proj, k_norm, RoPE, v_proj, the write), 2
        per layer with this (norm and RoPE in one kernel, the write) plus the one GEMM. A copy, not views: the
        layers' own q/k/v merge (fuse_weights) keeps its parameters, and nothing trains an inference engine's
        drafter."""
        with torch.no_grad():
            self.context_kv_weight = torch.cat(
                [w for layer in self.layers for w in (layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight)]
            ).contiguous()

    def pack_for_cpu(self) -> None:
        """The fast CPU path (models.llama.use_fast_cpu_path): fc and every layer's context keys and values as packed
        GEMMs (cpu_gemm), k_norm and RoPE through the C kernels. The context write then takes ~10 ops, not ~20."""
        self.fuse_context_weights()
        assert self.context_kv_weight is not None
        self.fc_packed = cpu_gemm.pack(self.fc.weight)
        self.context_kv_packed = cpu_gemm.pack(self.context_kv_weight)

    def context_features(self, taps: torch.Tensor) -> torch.Tensor:
        """[n, n_taps * hidden] -> [n, hidden]."""
        taps = taps.to(self.fc.weight.dtype)
        if self.fc_packed is not None and not torch.is_grad_enabled():
            return self.hidden_norm(cpu_gemm.linear(taps, self.fc_packed, None))
        return self.hidden_norm(self.fc(taps))

    def write_context(
        self,
        features: torch.Tensor,  # [rows >= n, hidden]: rows past n are padding
        positions: torch.Tensor,  # [n]
        slots: torch.Tensor,  # [n] int64, all valid (or -1 for padding rows with skip_padding)
        caches: list[KVCache],
        skip_padding: bool = False,  # slots may be -1: write with the Triton kernel, which skips them (CUDA only)
    ) -> None:
        """Store the context keys and values of every draft layer: what later blocks attend to.

        NOTE: the projections run on the padded rows and are cut after, so a token's key never depends on how many
        tokens were written beside it (utils/numerics.py)."""
        n = positions.shape[0]
        rope = self.rotary(positions)
        if self.context_kv_weight is not None and fused_ops.enabled(features):
            self._write_context_fused(features, n, rope, slots, caches)
            return
        if self.context_kv_packed is not None and not torch.is_grad_enabled() and not skip_padding:
            self._write_context_packed(features, n, rope, slots, caches)
            return
        for layer, cache in zip(self.layers, caches, strict=True):
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(features)[:n].view(n, attn.num_kv_heads, attn.head_dim))
            v = attn.v_proj(features)[:n].view(n, attn.num_kv_heads, attn.head_dim)
            if skip_padding:
                from dspark.attention.triton_kernels import write_kv as write_kv_skipping

                write_kv_skipping(cache.key, cache.value, apply_rotary(k, rope).contiguous(), v.contiguous(), slots)
            else:
                write_kv(cache, apply_rotary(k, rope), v, slots)

    def _write_context_fused(
        self,
        features: torch.Tensor,
        n: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        caches: list[KVCache],
    ) -> None:
        """write_context on CUDA: one GEMM for all layers' keys and values, then per layer k_norm and RoPE in place in
        one kernel and the Triton write (which skips slot -1). k and v stay strided views of the GEMM's output."""
        from dspark.attention.triton_kernels import write_kv as write_kv_triton

        assert self.context_kv_weight is not None
        kv = F.linear(features, self.context_kv_weight)[:n]
        for (attn, k, v), cache in zip(self._context_kv_views(kv), caches, strict=True):
            fused_ops.rotary_k(k, *rope, (attn.k_norm.weight, attn.k_norm.eps))
            write_kv_triton(cache.key, cache.value, k, v, slots)

    def _write_context_packed(
        self,
        features: torch.Tensor,
        n: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        caches: list[KVCache],
    ) -> None:
        """write_context on the fast CPU path: one packed GEMM for all layers' keys and values; per layer k_norm (C,
        heads as rows) and RoPE in place on its output, then the write."""
        assert self.context_kv_packed is not None
        kv = cpu_gemm.linear(features, self.context_kv_packed, None)[:n]
        for (attn, k, v), cache in zip(self._context_kv_views(kv), caches, strict=True):
            k = attn.k_norm(k)
            if attn.cpu_fused and cpu_kernels.supports(k) and k.is_contiguous():
                cpu_kernels.rotary_(k, *rope)  # in place: the norm's output is a new tensor
            else:
                k = apply_rotary(k, rope)
            write_kv(cache, k, v, slots)

    def _context_kv_views(self, kv: torch.Tensor) -> list[tuple[Attention, torch.Tensor, torch.Tensor]]:
        """Per draft layer, its attention and its keys and values [n, kv_heads, head_dim] out of kv [n, layers * 2 *
        kv_heads * head_dim], the output of one GEMM with context_kv_weight (each layer's k_proj rows, then its
        v_proj rows). Strided views, not copies: the fused path's k_norm and RoPE write the keys in place."""
        n = kv.shape[0]
        attn0 = self.layers[0].self_attn
        width = attn0.num_kv_heads * attn0.head_dim  # the same in every layer (one layer_config)
        out = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            k = kv[:, 2 * i * width : (2 * i + 1) * width].view(n, attn.num_kv_heads, attn.head_dim)
            v = kv[:, (2 * i + 1) * width : (2 * i + 2) * width].view(n, attn.num_kv_heads, attn.head_dim)
            out.append((attn, k, v))
        return out

    def mask_input(self, embed: nn.Embedding) -> torch.Tensor:
        """[hidden]: the input of a block's masked slots."""
        if self.config.mask_token_id is None:
            return self.mask_embedding
        return embed.weight[self.config.mask_token_id]

    def backbone(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the embedded blocks, flattened
        positions: torch.Tensor,  # [num_tokens]
        ctx: AttentionContext,  # non-causal metadata over the drafter's caches
    ) -> torch.Tensor:  # [num_tokens, hidden], normed
        rope = self.rotary(positions)
        for layer in self.layers:
            x = layer(x, rope, ctx)
        return self.norm(x)
