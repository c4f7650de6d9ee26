"""The scheduling maths of confidence-scheduled verification (DESIGN.md section 4), against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark.spec.cost_model import CostCurve
from dspark.spec.scheduling import (
    allocate,
    choose_budget,
    choose_budget_sync,
    smooth_confidences,
    survival,
    valid_slots,
)


def _random_survivals(g: torch.Generator, num_reqs: int, k: int, ties: bool = False) -> torch.Tensor:
    c = torch.rand(num_reqs, k, generator=g)
    if ties:
        c = (c * 4).round() / 4  # few distinct values: many exact ties
    return survival(c)


def test_survival_is_a_non_increasing_running_product() -> None:
    c = torch.tensor([[0.9, 0.5, 1.0, 0.2], [1.2, -0.1, 0.5, 0.5]])
    a = survival(c)
    assert torch.allclose(a[0], torch.tensor([0.9, 0.45, 0.45, 0.09]))
    assert a[1].tolist() == [1.0, 0.0, 0.0, 0.0]  # clamped into [0, 1]
    assert (a[:, 1:] <= a[:, :-1]).all()


def test_ema_smoothing() -> None:
    prev, cur = torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])
    assert torch.equal(smooth_confidences(None, cur, 0.8), cur)  # a new request starts from its own value
    assert torch.equal(smooth_confidences(prev, cur, 0.0), cur)  # alpha 0 disables it
    assert torch.allclose(smooth_confidences(prev, cur, 0.8), torch.tensor([0.6, 0.4]))


def _brute_allocate(a: torch.Tensor, caps: torch.Tensor, budget: int) -> list[int]:
    slots = [(-float(a[r, j]), j, r) for r in range(a.shape[0]) for j in range(int(caps[r]))]
    counts = [0] * a.shape[0]
    for _, _, r in sorted(slots)[:budget]:
        counts[r] += 1
    return counts


@pytest.mark.parametrize("ties", [False, True])
def test_allocate_takes_the_top_slots_with_a_value_free_tie_break(ties: bool) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        num_reqs, k = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
        a = _random_survivals(g, num_reqs, k, ties)
        caps = torch.randint(0, k + 1, (num_reqs,), generator=g)
        budget = int(torch.randint(0, num_reqs * k + 3, (1,), generator=g))
        counts = allocate(a, caps, budget)
        assert counts.tolist() == _brute_allocate(a, caps, budget)
        assert (counts <= caps).all() and int(counts.sum()) == min(budget, int(caps.sum()))


def test_ties_go_to_the_lower_position_then_the_lower_request() -> None:
    a = torch.full((3, 3), 0.5)
    caps = torch.tensor([3, 3, 3])
    assert allocate(a, caps, 4).tolist() == [2, 1, 1]  # (r0,j0) (r1,j0) (r2,j0) (r0,j1)


def test_whether_a_draft_is_verified_does_not_depend_on_its_value() -> None:
    """Draft j's value moves only the survivals after it (a_r,j+1..): changing those never drops slot (r, j)."""
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        a = _random_survivals(g, 4, 5, ties=bool(torch.rand(1, generator=g) < 0.5))
        caps = torch.full((4,), 5)
        budget = int(torch.randint(0, 21, (1,), generator=g))
        counts = allocate(a, caps, budget)
        r, j = int(torch.randint(0, 4, (1,), generator=g)), int(torch.randint(0, 4, (1,), generator=g))
        b = a.clone()
        b[r, j + 1 :] = a[r, j] * survival(torch.rand(4 - j, generator=g))  # any continuation of the same prefix
        chosen_before = counts[r] > j
        assert chosen_before == (allocate(b, caps, budget)[r] > j)


def _jagged_cost() -> CostCurve:
    # A step curve with a cliff: 8 tokens cost like 16 (padding to the next captured size).
    return CostCurve(sizes=[1, 2, 4, 8, 16, 32], ms=[10, 10, 10, 11, 20, 21], capture_limit=32)


def _brute_budget(a: torch.Tensor, caps: torch.Tensor, n_sampling: int, tokens: int, curve: CostCurve) -> int:
    values = sorted(valid_slots(a, caps).flatten().tolist(), reverse=True)[: int(caps.sum())]
    best, best_rate = 0, -1.0
    for b in range(len(values) + 1):
        rate = (n_sampling + sum(values[:b])) / (2.0 + float(curve(torch.tensor([tokens + b]))[0]))
        if rate > best_rate:
            best, best_rate = b, rate
    return best


def test_choose_budget_is_the_global_argmax() -> None:
    g = torch.Generator().manual_seed(2)
    curve = _jagged_cost()
    for _ in range(100):
        a = _random_survivals(g, 4, 4)
        caps = torch.randint(0, 5, (4,), generator=g)
        got = choose_budget(valid_slots(a, caps), int(caps.sum()), 4, 4, 4, curve, lambda r: 2.0)
        assert got == _brute_budget(a, caps, 4, 4, curve)


def test_the_global_argmax_sees_past_a_dip_that_stops_algorithm_1() -> None:
    """One token past 8 costs a whole padded step (ms 11 -> 20); a little further it pays off again."""
    curve = CostCurve(sizes=[1, 4, 8, 16, 32], ms=[10, 10, 11, 20, 20.5], capture_limit=32)
    a = torch.tensor([[0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99]] * 3)
    caps = torch.tensor([8, 8, 8])
    tokens, sampling = 3, 3
    b_star = choose_budget(a, 24, sampling, tokens, 3, curve, lambda r: 0.0)
    assert b_star == 24  # 3 + 24 = 27 tokens, padded to 32 at 20.5 ms: 26.8 tokens for 20.5 ms beats 7.95 for 11
    counts = choose_budget_sync(a, caps, sampling, tokens, 3, curve, lambda r: 0.0)
    assert int(counts.sum()) == 5  # 3 + 5 = 8 tokens: the next slot would cross the cliff, so it stops
    assert counts.tolist() == [2, 2, 1]


def test_zero_confidence_verifies_nothing() -> None:
    curve = CostCurve(sizes=[1, 64], ms=[5.0, 9.0])
    a = torch.zeros(3, 4)
    assert choose_budget(a, 12, 3, 3, 3, curve, lambda r: 1.0) == 0
    assert choose_budget_sync(a, torch.full((3,), 4), 3, 3, 3, curve, lambda r: 1.0).tolist() == [0, 0, 0]


@pytest.mark.parametrize("num_reqs,k", list(itertools.product([1, 3], [1, 4])))
def test_free_verification_verifies_every_valid_draft(num_reqs: int, k: int) -> None:
    curve = CostCurve(sizes=[1, 1024], ms=[5.0, 5.0])  # flat: drafts cost nothing
    a = torch.full((num_reqs, k), 0.5)
    assert choose_budget(a, num_reqs * k, num_reqs, num_reqs, num_reqs, curve, lambda r: 1.0) == num_reqs * k
    counts = choose_budget_sync(a, torch.full((num_reqs,), k), num_reqs, num_reqs, num_reqs, curve, lambda r: 1.0)
    assert counts.tolist() == [k] * num_reqs
