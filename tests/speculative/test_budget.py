"""The scheduling maths of confidence-scheduled verification (docs/scheduling.md), against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark.speculative.budget import (
    allocate,
    choose_budget,
    choose_budget_sync,
    flat_layout,
    smooth_confidences,
    survival,
)
from dspark.speculative.cost_model import CostModel


def _random_survivals(g: torch.Generator, num_reqs: int, k: int, ties: bool = False) -> torch.Tensor:
    c = torch.rand(num_reqs, k, generator=g).clamp(min=0.01)  # every slot holds a draft (survival > 0)
    if ties:
        c = (c * 4).ceil() / 4  # few distinct values: many exact ties
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
        counts = allocate(a, budget, caps)
        assert counts.tolist() == _brute_allocate(a, caps, budget)
        assert (counts <= caps).all() and int(counts.sum()) == min(budget, int(caps.sum()))


def test_ties_go_to_the_lower_position_then_the_lower_request() -> None:
    a = torch.full((3, 3), 0.5)
    caps = torch.tensor([3, 3, 3])
    assert allocate(a, 4, caps).tolist() == [2, 1, 1]  # (r0,j0) (r1,j0) (r2,j0) (r0,j1)


def test_whether_a_draft_is_verified_does_not_depend_on_its_value() -> None:
    """Draft j's value moves only the survivals after it (a_r,j+1..): changing those never drops slot (r, j)."""
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        a = _random_survivals(g, 4, 5, ties=bool(torch.rand(1, generator=g) < 0.5))
        caps = torch.full((4,), 5)
        budget = int(torch.randint(0, 21, (1,), generator=g))
        counts = allocate(a, budget, caps)
        r, j = int(torch.randint(0, 4, (1,), generator=g)), int(torch.randint(0, 4, (1,), generator=g))
        b = a.clone()
        b[r, j + 1 :] = a[r, j] * survival(torch.rand(4 - j, generator=g))  # any continuation of the same prefix
        chosen_before = counts[r] > j
        assert chosen_before == (allocate(b, budget, caps)[r] > j)


def _cost(sizes: list[int], ms: list[float], limit: int = 0, draft: float = 0.0) -> CostModel:
    return CostModel.from_points(dict(zip(sizes, ms, strict=True)), {1: draft, 4096: draft}, limit)


def _brute_budget(a: torch.Tensor, n_sampling: int, tokens: int, cost: CostModel) -> int:
    values = sorted((v for v in a.flatten().tolist() if v > 0), reverse=True)
    rates = [(n_sampling + sum(values[:b])) / cost.step_ms(n_sampling, tokens + b) for b in range(len(values) + 1)]
    return max(range(len(rates)), key=lambda b: (rates[b], -b))


def test_choose_budget_is_the_global_argmax_over_a_jagged_curve() -> None:
    g = torch.Generator().manual_seed(2)
    cost = _cost([1, 2, 4, 8, 16, 32], [10, 10, 10, 11, 20, 21], limit=32, draft=2.0)
    for _ in range(200):
        a = _random_survivals(g, 4, 4)
        a[torch.rand(4, generator=g) < 0.3, int(torch.randint(0, 4, (1,), generator=g)) :] = 0.0  # fewer drafts
        assert choose_budget(a, 4, 4, cost) == _brute_budget(a, 4, 4, cost)


def test_the_budget_stops_where_drafts_stop_paying() -> None:
    """Flat to 16 tokens, then a cliff to twice the cost: 4 requests verify up to 12 drafts, never 13."""
    cost = _cost([1, 16, 32], [10.0, 10.0, 20.0], limit=32)
    a = torch.full((4, 8), 0.9).cumprod(dim=1)
    assert choose_budget(a, 4, 4, cost) == 12
    assert int(choose_budget_sync(a, 4, 4, cost).sum()) == 12
    # A smaller cliff (x1.5) is worth crossing for near-certain drafts: 36 tokens (the linear tail past 32) at 16.25 ms
    # carry 35.8 expected tokens, 2.2 per ms against 1.6 for stopping at 16.
    certain = torch.full((4, 8), 0.999).cumprod(dim=1)
    assert choose_budget(certain, 4, 4, _cost([1, 16, 32], [10.0, 10.0, 15.0], limit=32)) == 32


def test_the_global_argmax_sees_past_a_dip_that_stops_algorithm_1() -> None:
    """One token past 8 costs a whole padded step (ms 11 -> 20); a little further it pays off again."""
    cost = _cost([1, 4, 8, 16, 32], [10, 10, 11, 20, 20.5], limit=32)
    a = torch.full((3, 8), 0.99)
    assert (
        choose_budget(a, 3, 3, cost) == 24
    )  # 27 tokens, padded to 32 at 20.5 ms: 26.8 tokens / 20.5 ms beats 7.95 / 11
    counts = choose_budget_sync(a, 3, 3, cost)
    assert counts.tolist() == [2, 2, 1]  # 3 + 5 = 8 tokens: the next slot would cross the cliff, so it stops


def test_zero_survival_or_no_drafts_verifies_nothing() -> None:
    cost = _cost([1, 64], [5.0, 9.0], draft=1.0)
    assert choose_budget(torch.zeros(3, 4), 3, 3, cost) == 0
    assert choose_budget_sync(torch.zeros(3, 4), 3, 3, cost).tolist() == [0, 0, 0]
    assert choose_budget(torch.zeros(0, 4), 0, 5, cost) == 0


@pytest.mark.parametrize("num_reqs,k", list(itertools.product([1, 3], [1, 4])))
def test_flat_cost_verifies_every_draft(num_reqs: int, k: int) -> None:
    cost = _cost([1, 1024], [5.0, 5.0], draft=1.0)  # drafts cost nothing to verify
    a = torch.full((num_reqs, k), 0.5)
    assert choose_budget(a, num_reqs, num_reqs, cost) == num_reqs * k
    assert choose_budget_sync(a, num_reqs, num_reqs, cost).tolist() == [k] * num_reqs


def test_allocation_is_a_capped_prefix_summing_to_the_budget() -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        num_reqs, k = int(torch.randint(1, 12, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        a = _random_survivals(g, num_reqs, k, ties=True)
        held = torch.randint(0, k + 1, (num_reqs,), generator=g)
        a[torch.arange(k)[None, :] >= held[:, None]] = 0.0  # slots past a request's drafts hold none
        caps = torch.randint(0, k + 1, (num_reqs,), generator=g)
        budget = int(torch.randint(0, num_reqs * k + 2, (1,), generator=g))
        counts = allocate(a, budget, caps)
        assert (counts >= 0).all() and (counts <= torch.minimum(caps, held)).all()
        assert int(counts.sum()) == min(budget, int(torch.minimum(caps, held).sum()))
        assert allocate(a, budget).tolist() == allocate(a, budget, torch.full((num_reqs,), k)).tolist()


def test_allocation_ignores_which_request_holds_a_tied_value() -> None:
    """Permuting the values among tied slots never changes the counts: ties are broken by place, not value."""
    a = torch.tensor([[0.5, 0.25], [0.5, 0.25], [0.5, 0.5]])
    assert allocate(a, 4).tolist() == [1, 1, 2]  # 0.5 x 4 slots: (0,0) (1,0) (2,0) then (2,1)
    assert allocate(a, 3).tolist() == [1, 1, 1]


def test_flat_layout_matches_the_host_builder() -> None:
    bs = 4
    num_plain = torch.tensor([1, 5, 1, 0])
    counts = torch.tensor([3, 0, 2, 0])
    computed = torch.tensor([6, 0, 13, 2])
    tables = torch.tensor([[7, 2, 9, 0, 0], [3, 4, 0, 0, 0], [1, 5, 6, 8, 11], [10, 0, 0, 0, 0]])
    n = int((num_plain + counts).sum())
    pad = 5  # rows past the requests': slot -1, position 0
    lay = flat_layout(num_plain, counts, computed, tables, bs, n + pad)
    want_pos, want_slots, want_qs, want_owner, want_offset = [], [], [0], [], []
    for r in range(4):
        for i, p in enumerate(range(int(computed[r]), int(computed[r] + num_plain[r] + counts[r]))):
            want_pos.append(p)
            want_slots.append(int(tables[r, p // bs]) * bs + p % bs)
            want_owner.append(r)
            want_offset.append(i)
        want_qs.append(len(want_pos))
    assert lay.query_start.tolist() == want_qs
    assert lay.positions.tolist() == want_pos + [0] * pad and lay.slots.tolist() == want_slots + [-1] * pad
    assert lay.owner[:n].tolist() == want_owner and lay.offset[:n].tolist() == want_offset
    assert lay.real.tolist() == [True] * n + [False] * pad
    assert lay.seq_lens.tolist() == [10, 5, 16, 0]  # an empty request has no context in the step
    zero = flat_layout(num_plain, torch.zeros(4, dtype=torch.int64), computed, tables, bs, int(num_plain.sum()))
    assert zero.query_start.tolist() == [0, 1, 6, 7, 7]  # budget 0: exactly the plain tokens' offsets


def test_the_float_budget_choice_is_the_tensor_one() -> None:
    """Few requests choose their budget in Python floats: the same sums in the same order, the same first maximum."""
    from dspark.speculative.budget import _choose_budget_arrays, _choose_budget_floats
    from dspark.speculative.cost_model import RefinedCostModel

    gen = torch.Generator().manual_seed(1)
    base = CostModel.from_points({1: 1.0, 8: 1.0, 16: 1.3, 64: 2.0, 256: 6.0}, {1: 0.4, 64: 0.9}, capture_limit=16)
    refined = RefinedCostModel(base)
    for r in range(1, 40):
        refined.observe(r, base.step_ms(r, r), base.step_ms(r, r) + 0.01 * r, speculative=True)
    for trial in range(400):
        num_reqs = 1 + trial % 9
        a = survival(torch.rand(num_reqs, 7, generator=gen) ** 0.3)
        a[:, int(torch.randint(1, 8, (1,), generator=gen)) :] *= trial % 3 == 0  # some rows hold fewer drafts
        if trial % 7 == 0:
            a = torch.full_like(a, 0.5)  # ties
        for cost in (base, refined):
            want = _choose_budget_arrays(a, num_reqs, num_reqs + trial % 5, cost, None)
            assert _choose_budget_floats(a, num_reqs, num_reqs + trial % 5, cost, None) == want, (trial, a)


def _torch_budget(a: torch.Tensor, num_sampling: int, num_other: int, cost: CostModel) -> int:
    """The budget choice in torch tensor ops (what ran before the numpy path): the reference."""
    values = a.flatten().double()
    top = torch.sort(values[values > 0], descending=True).values
    gains = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(top, 0)]) + num_sampling
    budgets = torch.arange(top.numel() + 1, dtype=torch.int64)
    return int(torch.argmax(gains / cost.step_ms(num_sampling, num_other + budgets)))


def test_the_array_budget_choice_is_the_tensor_one_at_many_requests() -> None:
    """Many requests choose their budget in numpy: the same sort, sums and first maximum as in torch, ties included.
    (The float path of few requests can part from both on a tie of the last bits: its cost curve is evaluated per
    budget, not as a vector; at trial 18 below the rates of budgets 447 and 448 differ by 3e-14.)"""
    gen = torch.Generator().manual_seed(2)
    cost = CostModel.from_points({1: 1.0, 512: 1.4, 2048: 3.0, 8192: 9.0}, {1: 1.0, 1024: 3.0}, capture_limit=512)
    for trial in range(24):
        num_reqs = (64, 300, 1024)[trial % 3]
        a = survival(torch.rand(num_reqs, 7, generator=gen) ** (0.1 + trial / 8))
        if trial % 4 == 0:
            a = torch.full_like(a, 0.25)  # ties everywhere
        if trial % 5 == 0:
            a[::3, 2:] = 0  # some rows hold fewer drafts
        for x in (a, a.float()):
            assert choose_budget(x, num_reqs, num_reqs, cost) == _torch_budget(x, num_reqs, num_reqs, cost), trial
