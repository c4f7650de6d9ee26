"""The DSpark drafter's training forward: many blocks of one target-generated sequence in one dense pass.

Inference drafts one block per request over a paged context cache (spec/dspark/proposer.py); training packs B blocks
of one sequence, anchored at different positions, into one pass with an explicit mask (train/anchors.py): each block
attends to the context features strictly before its anchor and bidirectionally to itself, exactly what the paged
path computes for a block at that anchor (tests/spec/test_dspark_drafter.py checks both against one dense reference).

The target is frozen and run online, once per sequence, for both what the drafter reads (its tapped layers) and what
it learns from (its logits at the block positions): no feature cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.models.llama import CausalLM, apply_rotary
from dspark.spec.dspark.model import DSparkModel
from dspark.train.anchors import block_attention_mask
from dspark.worker.attention.base import AttentionContext, AttentionMetadata, KVCache
from dspark.worker.attention.torch_ref import TorchAttention

SCRATCH_BLOCK = 16


@dataclass
class TargetPass:
    hidden: torch.Tensor  # [S, H] the target's final (normed) states
    taps: torch.Tensor  # [S, n_taps * H] its tapped layers' raw outputs


@torch.no_grad()
def target_pass(target: CausalLM, tokens: torch.Tensor, tap_layers: tuple[int, ...]) -> TargetPass:
    """Prefill one sequence through the frozen target (its own attention, a scratch paged cache)."""
    cfg, n, dev = target.config, tokens.numel(), tokens.device
    dtype = target.lm_head.weight.dtype
    nb = -(-n // SCRATCH_BLOCK)
    shape = (nb, SCRATCH_BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = [
        KVCache(torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev))
        for _ in range(cfg.num_layers)
    ]
    meta = AttentionMetadata(
        num_actual_tokens=n,
        slot_mapping=torch.arange(n, device=dev),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None],
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
        max_query_len=n,
        max_seq_len=n,
    )
    backend = TorchAttention()
    backend.prepare(meta, cfg.num_kv_heads, cfg.num_heads, SCRATCH_BLOCK)
    hidden, taps = target.forward_with_taps(
        tokens, torch.arange(n, device=dev), AttentionContext(backend, meta, caches), tap_layers
    )
    return TargetPass(hidden, taps if taps is not None else hidden.new_zeros(n, 0))


def block_states(
    model: DSparkModel,
    embed: torch.nn.Embedding,  # the target's
    tokens: torch.Tensor,  # [S] the sequence
    features: torch.Tensor,  # [S, H] context features of every position (model.context_features of the taps)
    anchors: torch.Tensor,  # [B] int64, each >= 1 and < S
) -> torch.Tensor:  # [B, K, H] the blocks' final (normed) states
    cfg = model.config
    k, nh, nkv, hd = cfg.block_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b, s, dev = anchors.numel(), features.shape[0], features.device
    n = b * k
    x = model.mask_input(embed).to(features.dtype).expand(n, -1).clone()
    x[torch.arange(b, device=dev) * k] = embed(tokens[anchors]).to(x.dtype)
    rope_block = model.rotary((anchors[:, None] + torch.arange(k, device=dev)[None, :]).flatten())
    rope_ctx = model.rotary(torch.arange(s, device=dev))
    mask = block_attention_mask(anchors.cpu(), s, k).to(dev)[None, None]  # [1, 1, n, s + n]
    for layer in model.layers:
        at = layer.self_attn
        h = layer.input_layernorm(x)
        q = at.q_norm(at.q_proj(h).view(n, nh, hd))
        kb = at.k_norm(at.k_proj(h).view(n, nkv, hd))
        vb = at.v_proj(h).view(n, nkv, hd)
        kc = at.k_norm(at.k_proj(features).view(s, nkv, hd))  # as write_context stores them
        vc = at.v_proj(features).view(s, nkv, hd)
        q, kb, kc = apply_rotary(q, rope_block), apply_rotary(kb, rope_block), apply_rotary(kc, rope_ctx)
        keys = torch.cat([kc, kb]).repeat_interleave(nh // nkv, dim=1).transpose(0, 1)[None]  # [1, nh, s + n, hd]
        values = torch.cat([vc, vb]).repeat_interleave(nh // nkv, dim=1).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask, scale=at.scale)
        x = x + at.o_proj(o[0].transpose(0, 1).reshape(n, nh * hd))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x).view(b, k, -1)


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
