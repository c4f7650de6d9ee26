"""Growing a drafter (dspark/train/grow.py): new layers on top start as the identity, so the grown drafter computes
exactly what its source does, and training moves them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark.models.loader import load_config, load_model
from dspark.speculative.drafters.dspark.checkpoint import load_drafter, random_drafter, save_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig
from dspark.train.grow import grow
from dspark.train.trainer import batch_loss, make_optimizer, optimiser_step, pad_batch

CPU = torch.device("cpu")


def _losses(model: torch.nn.Module, target: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> list[float]:
    losses = batch_loss(model, target, tokens, mask, num_blocks=6, generator=torch.Generator().manual_seed(1))
    assert losses is not None
    return [float(losses.total.detach()), losses.acceptance]


def test_a_grown_drafter_computes_what_its_source_does_until_it_trains(
    tmp_path: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    target = load_model(tiny_model_dirs["llama"], torch.float32, CPU)
    for p in target.parameters():
        p.requires_grad_(False)
    cfg = DSparkConfig.for_target(load_config(tiny_model_dirs["llama"]), num_layers=1, block_size=4, markov_rank=8)
    source = random_drafter(cfg, seed=2)
    with torch.no_grad():  # every weight away from its initial value, so a layer left out would show
        for p in source.parameters():
            p.add_(0.05 * torch.randn_like(p))
    source = load_drafter(save_drafter(source, tmp_path / "source"), target.config, torch.float32, CPU)
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(3, 900, (30,), generator=g).tolist(), 6) for _ in range(3)]
    tokens, mask = pad_batch(seqs, CPU)

    grown = grow(source, 2, seed=5)
    assert grown.config.num_layers == 3 and len(grown.layers) == 3
    assert _losses(grown, target, tokens, mask) == _losses(source, target, tokens, mask)  # bit for bit
    for name, t in source.state_dict().items():
        assert torch.equal(grown.state_dict()[name], t), name
    # It saves and loads as a 3-layer drafter, still the source's function.
    reloaded = load_drafter(save_drafter(grown, tmp_path / "grown"), target.config, torch.float32, CPU)
    assert reloaded.config.num_layers == 3
    assert _losses(reloaded, target, tokens, mask) == _losses(source, target, tokens, mask)

    grown.train()
    optimizer, scheduler = make_optimizer(grown, 10, lr=1e-3)
    for _ in range(2):
        losses = batch_loss(grown, target, tokens, mask, num_blocks=6, generator=g)
        assert losses is not None
        optimiser_step(grown, optimizer, scheduler, losses.total)
    for layer in grown.layers[1:]:  # the zero projections got gradients and moved
        assert layer.self_attn.o_proj.weight.abs().max() > 0 and layer.mlp.down_proj.weight.abs().max() > 0
    assert _losses(grown, target, tokens, mask) != _losses(source, target, tokens, mask)


def test_growing_by_nothing_is_an_error(tiny_model_dirs: dict[str, Path]) -> None:
    cfg = DSparkConfig.for_target(load_config(tiny_model_dirs["llama"]), num_layers=1, block_size=4, markov_rank=8)
    with pytest.raises(ValueError, match="num_new=0"):
        grow(random_drafter(cfg), 0)
