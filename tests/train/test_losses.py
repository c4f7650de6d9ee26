"""The drafter's training losses and block sampling, on small tensors with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from dspark.train.anchors import block_attention_mask, sample_blocks, valid_anchors
from dspark.train.losses import dspark_losses, position_weights


def test_a_perfect_draft_has_zero_l1_full_acceptance_and_only_the_target_entropy_as_ce() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 10, generator=g)
    labels = torch.randint(0, 10, (3, 4), generator=g)
    mask = torch.ones(3, 4, dtype=torch.bool)
    out = dspark_losses(logits, logits.clone(), labels, mask, confidence_logits=torch.full((3, 4), 20.0))
    assert out.l1 == pytest.approx(0.0, abs=1e-6) and out.acceptance == pytest.approx(1.0)
    ce = -torch.log_softmax(logits, -1).gather(-1, labels[..., None]).mean()
    assert out.ce == pytest.approx(float(ce), rel=1e-5)
    assert out.bce == pytest.approx(0.0, abs=1e-6)  # confident and right


def test_disjoint_drafts_have_l1_two_and_zero_acceptance() -> None:
    draft = torch.full((1, 2, 4), -1e4)
    target = torch.full((1, 2, 4), -1e4)
    draft[..., 0] = 0.0
    target[..., 1] = 0.0
    out = dspark_losses(draft, target, torch.ones(1, 2, dtype=torch.int64), torch.ones(1, 2, dtype=torch.bool))
    assert out.l1 == pytest.approx(2.0) and out.acceptance == pytest.approx(0.0)


def test_position_weights_and_masking() -> None:
    assert torch.allclose(position_weights(3), torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))
    g = torch.Generator().manual_seed(1)
    d, t = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    labels = torch.randint(0, 8, (2, 3), generator=g)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    masked = dspark_losses(d, t, labels, mask)
    garbage = d.clone()
    garbage[0, 2] = 1e3 * torch.randn(8, generator=g)  # a masked position can hold anything
    assert float(dspark_losses(garbage, t, labels, mask).total) == pytest.approx(float(masked.total))


def test_the_confidence_learns_acceptance_without_pulling_the_draft() -> None:
    g = torch.Generator().manual_seed(2)
    d = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    t = torch.randn(2, 3, 8, generator=g)
    conf = torch.zeros(2, 3, requires_grad=True)
    labels = torch.randint(0, 8, (2, 3), generator=g)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with_conf = dspark_losses(d, t, labels, mask, conf)
    with_conf.total.backward()
    grad_with = d.grad.clone()
    d.grad = None
    dspark_losses(d, t, labels, mask).total.backward()
    assert torch.allclose(d.grad, grad_with)  # BCE's target is detached: no gradient into the draft
    assert conf.grad is not None and conf.grad.abs().sum() > 0


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="shapes disagree"):
        dspark_losses(
            torch.zeros(1, 2, 3),
            torch.zeros(1, 2, 4),
            torch.zeros(1, 2, dtype=torch.int64),
            torch.ones(1, 2, dtype=torch.bool),
        )


def test_anchors_start_in_the_response_and_labels_follow() -> None:
    tokens = torch.arange(100, 112)
    loss_mask = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1], dtype=torch.bool)  # prompt of 4 tokens
    assert valid_anchors(loss_mask).tolist() == [4, 5, 6, 7, 8, 9, 10]
    g = torch.Generator().manual_seed(0)
    blocks = sample_blocks(tokens, loss_mask, block_size=3, num_blocks=50, generator=g)
    assert blocks.anchors.tolist() == [4, 5, 6, 7, 8, 9, 10]  # all of them, sorted
    last = blocks.anchors.tolist().index(10)
    assert blocks.labels[last].tolist() == [111, 0, 0] and blocks.mask[last].tolist() == [True, False, False]
    assert blocks.labels[0].tolist() == [105, 106, 107]
    again = sample_blocks(tokens, loss_mask, 3, 3, torch.Generator().manual_seed(5))
    assert (
        again.anchors.tolist()
        == sample_blocks(tokens, loss_mask, 3, 3, torch.Generator().manual_seed(5)).anchors.tolist()
    )
    assert again.mask[:, 0].all()  # no block without a label


def test_packed_blocks_see_their_context_and_themselves_only() -> None:
    m = block_attention_mask(torch.tensor([2, 5]), context_len=6, block_size=2)
    assert m.shape == (4, 10)
    assert m[0].tolist() == [True, True, False, False, False, False, True, True, False, False]
    assert m[3].tolist() == [True] * 5 + [False] + [False, False, True, True]
    assert m.any(dim=1).all()  # no fully masked row
