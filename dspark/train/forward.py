"""The DSpark drafter's training forward: many blocks of N target-generated sequences in one dense pass.

Inference drafts one block per request over a paged context cache (speculative/drafters/dspark/drafter.py); training
packs B blocks per sequence, anchored at different positions, into one pass with an explicit mask (train/anchors.py):
each block attends to its own sequence's context features strictly before its anchor and bidirectionally to itself,
exactly what the paged path computes for a block at that anchor (tests/speculative/drafters/test_dspark_drafter.py
checks both against one dense reference). Sequences are right-padded to one length S; padding is never attended (it
follows every real position of its row, and anchors lie before it).

The target is frozen and run online, once per batch, for both what the drafter reads (its tapped layers) and what
it learns from (its logits at the block positions): no feature cache. It runs with plain causal attention over the
padded batch (DenseCausalAttention), not the engine's paged path: training needs no cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.attention.base import AttentionContext, AttentionMetadata, KVCache
from dspark.models.llama import CausalLM, apply_rotary
from dspark.speculative.drafters.dspark.model import DSparkModel
from dspark.train.anchors import block_attention_mask


class DenseCausalAttention:
    """Training-only attention backend: N right-padded sequences of S tokens each, causal, no cache. Padding sits after
    every real token of its row, so no real position ever sees it."""

    name = "dense-causal"

    def __init__(self, batch: int, seq: int) -> None:
        self.batch, self.seq = batch, seq

    def prepare(self, meta: AttentionMetadata, num_kv_heads: int, num_heads: int, block_size: int) -> None:
        pass

    def forward(
        self,
        q: torch.Tensor,  # [N * S, num_heads, head_dim]
        k: torch.Tensor,  # [N * S, num_kv_heads, head_dim]
        v: torch.Tensor,
        cache: KVCache | None,
        meta: AttentionMetadata | None,
        scale: float,
    ) -> torch.Tensor:
        n, s = self.batch, self.seq
        group = q.shape[1] // k.shape[1]
        qh = q.view(n, s, *q.shape[1:]).transpose(1, 2)
        kh = k.view(n, s, *k.shape[1:]).repeat_interleave(group, dim=2).transpose(1, 2)
        vh = v.view(n, s, *v.shape[1:]).repeat_interleave(group, dim=2).transpose(1, 2)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        return o.transpose(1, 2).reshape(n * s, *q.shape[1:])


@dataclass
class TargetPass:
    hidden: torch.Tensor  # [N, S, H] the target's final (normed) states
    taps: torch.Tensor  # [N, S, n_taps * H] its tapped layers' raw outputs


@torch.no_grad()
def target_pass(target: CausalLM, tokens: torch.Tensor, tap_layers: tuple[int, ...]) -> TargetPass:
    """Prefill N right-padded sequences [N, S] through the frozen target (dense causal attention, no cache)."""
    n, s = tokens.shape
    positions = torch.arange(s, device=tokens.device).repeat(n)
    ctx = AttentionContext(DenseCausalAttention(n, s), None, [None] * target.config.num_layers)  # type: ignore[arg-type]
    hidden, taps = target.forward_with_taps(tokens.flatten(), positions, ctx, tap_layers)
    taps = taps if taps is not None else hidden.new_zeros(n * s, 0)
    return TargetPass(hidden.view(n, s, -1), taps.view(n, s, -1))


def block_states(
    model: DSparkModel,
    embed: torch.nn.Embedding,  # the target's
    tokens: torch.Tensor,  # [N, S] right-padded sequences
    features: torch.Tensor,  # [N, S, H] context features of every position (model.context_features of the taps)
    anchors: torch.Tensor,  # [N, B] int64, each >= 1 and < the row's length
) -> torch.Tensor:  # [N, B, K, H] the blocks' final (normed) states
    cfg = model.config
    k, nh, nkv, hd = cfg.block_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    (n, b), s, dev = anchors.shape, features.shape[1], features.device
    m = b * k  # queries per row
    x = model.mask_input(embed).to(features.dtype).expand(n, b, k, -1).clone()
    x[:, :, 0] = embed(tokens.gather(1, anchors)).to(x.dtype)
    x = x.view(n * m, -1)
    rope_block = model.rotary((anchors[:, :, None] + torch.arange(k, device=dev)).flatten())
    rope_ctx = model.rotary(torch.arange(s, device=dev).repeat(n))
    mask = block_attention_mask(anchors, s, k)[:, None]  # [N, 1, m, s + m]
    ctx_features = features.reshape(n * s, -1)

    def heads(t: torch.Tensor, rows: int) -> torch.Tensor:  # [N * rows, h, hd] -> [N, nh, rows, hd]
        return t.view(n, rows, t.shape[1], hd).repeat_interleave(nh // t.shape[1], dim=2).transpose(1, 2)

    for layer in model.layers:
        at = layer.self_attn
        h = layer.input_layernorm(x)
        q = at.q_norm(at.q_proj(h).view(n * m, nh, hd))
        kb = at.k_norm(at.k_proj(h).view(n * m, nkv, hd))
        vb = at.v_proj(h).view(n * m, nkv, hd)
        kc = at.k_norm(at.k_proj(ctx_features).view(n * s, nkv, hd))  # as write_context stores them
        vc = at.v_proj(ctx_features).view(n * s, nkv, hd)
        q, kb, kc = apply_rotary(q, rope_block), apply_rotary(kb, rope_block), apply_rotary(kc, rope_ctx)
        keys = torch.cat([heads(kc, s), heads(kb, m)], dim=2)  # [N, nh, s + m, hd]
        values = torch.cat([heads(vc, s), heads(vb, m)], dim=2)
        o = F.scaled_dot_product_attention(heads(q, m), keys, values, attn_mask=mask, scale=at.scale)
        x = x + at.o_proj(o.transpose(1, 2).reshape(n * m, nh * hd))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x).view(n, b, k, -1)


def draft_outputs(
    model: DSparkModel,
    target: CausalLM,
    states: torch.Tensor,  # [B, K, H]
    previous: torch.Tensor,  # [B, K] the token before each position: the anchor, then the target's tokens
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Teacher-forced draft logits [B, K, V] (lm_head + Markov correction from the true previous token: a draft only
    counts once every earlier one was accepted, i.e. equals the target's) and confidence logits [B, K] (or None)."""
    logits = target.compute_logits(states.flatten(0, 1)).view(*states.shape[:2], -1).float()
    if model.markov_head is None:
        e = states.new_zeros(*states.shape[:2], 0)
    else:
        e, correction = model.markov_head(previous.flatten())
        e = e.view(*states.shape[:2], -1)
        logits = logits + correction.view_as(logits)
    conf = None
    if model.confidence_head is not None:
        conf = model.confidence_head.logit(states.flatten(0, 1), e.flatten(0, 1)).view(states.shape[:2])
    return logits, conf
