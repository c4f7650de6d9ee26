"""The DSpark drafter's context write on CUDA (skipped without a GPU; run with `pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from dspark.speculative.drafters.dspark.checkpoint import random_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_fused_context_write_equals_the_unfused_one() -> None:
    """The drafter's context keys and values from the merged GEMM (with k_norm and RoPE in one kernel) are those of
    the per-layer projections, slot for slot; padding rows (slot -1) write nothing."""
    from dspark.attention.base import KVCache
    from dspark.models.config import ModelConfig

    target = ModelConfig(
        family="llama", vocab_size=512, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=2048,
        tie_word_embeddings=True, attention_bias=False, qk_norm=False,
    )  # fmt: skip
    cfg = DSparkConfig.for_target(target, num_layers=2, block_size=7, markov_rank=16)
    dev = torch.device("cuda")
    model = random_drafter(cfg, seed=0).to(dev, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    n, pad = 37, 3
    features = torch.randn(n + pad, cfg.hidden_size, generator=gen).to(dev, torch.bfloat16)
    positions = torch.randint(0, 2000, (n,), generator=gen).to(dev)
    slots = torch.randperm(64 * 16, generator=gen)[:n].to(dev)
    slots[5] = -1  # a padding row inside the batch

    def caches() -> list[KVCache]:
        shape = (64, 16, cfg.layer_config.num_kv_heads, cfg.head_dim)
        return [
            KVCache(
                torch.zeros(shape, dtype=torch.bfloat16, device=dev),
                torch.zeros(shape, dtype=torch.bfloat16, device=dev),
            )
            for _ in range(cfg.num_layers)
        ]

    with torch.inference_mode():
        unfused = caches()
        model.write_context(features, positions, slots, unfused, skip_padding=True)
        model.fuse_context_weights()
        fused = caches()
        model.write_context(features, positions, slots, fused, skip_padding=True)
    for a, b in zip(unfused, fused, strict=True):
        torch.testing.assert_close(b.key, a.key, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(b.value, a.value, atol=0, rtol=0)
        assert a.key.abs().sum() > 0
