"""The drafter learns: a few dozen steps on sequences a tiny target generated itself raise its acceptance."""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.models.loader import load_model
from dspark.speculative.drafters.dspark.checkpoint import random_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig
from dspark.train.trainer import batch_loss, make_optimizer, optimiser_step, pad_batch
from helpers import make_hf_model


def _greedy(target: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation (through the training pass's prefill: slow but simple)."""
    from dspark.train.forward import target_pass

    tokens = list(prompt)
    for _ in range(n):
        out = target_pass(target, torch.tensor([tokens]), ())
        tokens.append(int(target.compute_logits(out.hidden[0, -1:]).argmax()))
    return tokens


def test_a_few_steps_raise_the_acceptance_estimate(tmp_path: Path) -> None:
    make_hf_model("qwen3", seed=0, num_hidden_layers=4).save_pretrained(tmp_path, safe_serialization=True)
    target = load_model(tmp_path, torch.float32, torch.device("cpu"))
    for p in target.parameters():
        p.requires_grad_(False)
    cfg = DSparkConfig.for_target(target.config, num_layers=1, block_size=4, num_taps=2, markov_rank=16)
    model = random_drafter(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (6,), generator=g).tolist() for _ in range(3)]
    data = []
    for prompt in prompts:
        tokens = _greedy(target, prompt, 26)
        data.append((tokens, len(prompt)))

    steps = 60
    optimizer, scheduler = make_optimizer(model, steps, lr=3e-3)
    first, last = [], []
    for step in range(steps):
        tokens, mask = pad_batch([data[step % len(data)]], torch.device("cpu"))
        losses = batch_loss(model, target, tokens, mask, num_blocks=8, generator=g)
        assert losses is not None
        (first if step < len(data) else last).append((float(losses.total.detach()), losses.acceptance))
        optimiser_step(model, optimizer, scheduler, losses.total)
    last = last[-len(data) :]
    mean = lambda xs, i: sum(x[i] for x in xs) / len(xs)  # noqa: E731
    assert mean(last, 0) < 0.6 * mean(first, 0), (first, last)  # with a margin to what a seeded run reaches
    assert mean(last, 1) > mean(first, 1) + 0.15, (first, last)  # likewise
