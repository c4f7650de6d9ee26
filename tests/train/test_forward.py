"""The batched training pass: padding and batch-mates change nothing a sequence's blocks compute."""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.models.loader import load_model
from dspark.speculative.drafters.dspark.checkpoint import random_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig
from dspark.train.forward import block_states, target_pass
from dspark.train.trainer import pad_batch
from helpers import make_hf_model


def test_a_sequence_computes_the_same_alone_and_padded_in_a_batch(tmp_path: Path) -> None:
    make_hf_model("qwen3", seed=0, num_hidden_layers=4).save_pretrained(tmp_path, safe_serialization=True)
    target = load_model(tmp_path, torch.float32, torch.device("cpu"))
    cfg = DSparkConfig.for_target(target.config, num_layers=2, block_size=4, num_taps=2, markov_rank=8)
    model = random_drafter(cfg, seed=1)
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(3, 1000, (n,), generator=g).tolist(), 3) for n in (9, 23, 16)]
    anchors = [torch.tensor([1, 5]), torch.tensor([2, 11, 19]), torch.tensor([14])]
    tokens, mask = pad_batch(seqs, torch.device("cpu"))
    assert tokens.shape == (3, 23) and mask.sum(1).tolist() == [6, 20, 13]
    # Rows with fewer blocks are padded with blocks at anchor 1, as batch_loss pads them (their labels masked out).
    padded = torch.stack([torch.cat([a, torch.ones(3 - a.numel(), dtype=torch.long)]) for a in anchors])
    with torch.no_grad():
        together = target_pass(target, tokens, cfg.target_layer_ids)
        states = block_states(model, target.model.embed_tokens, tokens, model.context_features(together.taps), padded)
        for i, (toks, _) in enumerate(seqs):
            alone = target_pass(target, torch.tensor([toks]), cfg.target_layer_ids)
            n = len(toks)
            torch.testing.assert_close(together.hidden[i, :n], alone.hidden[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(together.taps[i, :n], alone.taps[0], rtol=1e-5, atol=1e-5)
            one = block_states(
                model,
                target.model.embed_tokens,
                torch.tensor([toks]),
                model.context_features(alone.taps),
                anchors[i][None],
            )
            torch.testing.assert_close(states[i, : anchors[i].numel()], one[0], rtol=1e-5, atol=1e-5)
        # Not vacuous: another sequence's context gives other states for the same anchor.
        other = block_states(
            model, target.model.embed_tokens, tokens[1:2], model.context_features(together.taps[1:2]), anchors[0][None]
        )
        assert (other[0] - states[0, :2]).abs().max() > 1e-3
