"""Lossless verification: exact greedy cases, strict mode equal to plain seeded sampling, and the emitted
distribution equal to the target's for several draft/target pairs (statistical tests)."""

from __future__ import annotations

import pytest
import torch

from dspark.sample.random import inverse_cdf, uniform
from dspark.sample.rejection import VerifyRow, verify

V = 6


def _dist(*w: float) -> torch.Tensor:
    t = torch.tensor(w, dtype=torch.float32)
    return t / t.sum()


def test_greedy_accepts_the_matching_prefix_then_corrects() -> None:
    p = torch.eye(V)[[2, 4, 1, 5]]  # argmax per position: 2, 4, 1, bonus 5
    rows = [VerifyRow(seed=0, first_counter=0, draft_tokens=[2, 4, 3], greedy=True)]
    assert verify(p, None, rows, "strict") == [[2, 4, 1]]
    rows = [VerifyRow(seed=0, first_counter=0, draft_tokens=[2, 4, 1], greedy=True)]
    assert verify(p, None, rows, "strict") == [[2, 4, 1, 5]]  # all accepted: the bonus
    rows = [VerifyRow(seed=0, first_counter=0, draft_tokens=[], greedy=True)]
    assert verify(p[:1], None, rows, "strict") == [[2]]  # no drafts: plain greedy


def test_ragged_batch_rows_are_independent() -> None:
    p = torch.eye(V)[[1, 2, 3, 0, 5, 4]]
    rows = [
        VerifyRow(0, 0, [1, 2], greedy=True),  # rows 0-2
        VerifyRow(0, 7, [], greedy=True),  # row 3
        VerifyRow(0, 3, [0], greedy=True),  # rows 4-5: 0 != 5, corrected
    ]
    assert verify(p, None, rows, "strict") == [[1, 2, 3], [0], [5]]


def test_strict_equals_plain_seeded_sampling() -> None:
    """Whatever the drafts, strict verification emits what non-speculative sampling would have emitted."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(5, V, generator=g), dim=-1)
    seed, start = 1234, 10
    plain = [inverse_cdf(probs[k], uniform(seed, start + k)) for k in range(5)]
    for drafts in (
        [plain[0], plain[1], plain[2], plain[3]],
        [plain[0], (plain[1] + 1) % V, 0, 0],
        [(plain[0] + 1) % V],
    ):
        out = verify(probs[: len(drafts) + 1], None, [VerifyRow(seed, start, list(drafts))], "strict")[0]
        assert out == plain[: len(out)]
        assert len(out) == next((k + 1 for k, x in enumerate(drafts) if x != plain[k]), len(drafts) + 1)


PAIRS = {
    "same": (_dist(5, 1, 1, 1, 1, 1), _dist(5, 1, 1, 1, 1, 1)),
    "uniform draft": (_dist(6, 3, 1, 0, 0, 0), _dist(1, 1, 1, 1, 1, 1)),
    "draft misses target tokens": (_dist(1, 1, 1, 1, 0, 0), _dist(0, 0, 1, 0, 1, 1)),
    "disjoint supports": (_dist(1, 2, 0, 0, 0, 0), _dist(0, 0, 0, 1, 1, 1)),
    "peaked wrong draft": (_dist(1, 1, 1, 1, 1, 1), _dist(0, 0, 0, 0, 0, 1)),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_probabilistic_first_token_has_the_target_distribution(name: str) -> None:
    p, q = PAIRS[name]
    n = 20000
    counts = torch.zeros(V)
    for seed in range(n):
        # The draft is sampled from q with its own randomness, as a drafter would.
        x = inverse_cdf(q, uniform(seed, 0, stream=7))
        out = verify(torch.stack([p, p]), q[None], [VerifyRow(seed, 0, [x])])[0]
        counts[out[0]] += 1
    expected = p * n
    mask = expected > 0
    assert counts[~mask].sum() == 0, "a token the target gives probability 0 was emitted"
    chi2 = float((((counts - expected) ** 2)[mask] / expected[mask]).sum())
    # Critical value of chi-square at p = 0.001 with up to 5 degrees of freedom is 20.5; seeds are fixed, no flakes.
    assert chi2 < 20.5, f"{name}: emitted {counts.tolist()} vs expected {expected.tolist()} (chi2 {chi2:.1f})"


def test_probabilistic_second_token_after_acceptance_has_the_target_distribution() -> None:
    p1, q1 = _dist(3, 1, 1, 1, 1, 1), _dist(1, 1, 1, 1, 1, 1)
    p2, q2 = _dist(1, 4, 0, 2, 1, 0), _dist(2, 1, 1, 0, 1, 1)
    n = 30000
    counts = torch.zeros(V)
    for seed in range(n):
        x1 = inverse_cdf(q1, uniform(seed, 0, stream=7))
        x2 = inverse_cdf(q2, uniform(seed, 1, stream=7))
        out = verify(torch.stack([p1, p2, p2]), torch.stack([q1, q2]), [VerifyRow(seed, 0, [x1, x2])])[0]
        if len(out) >= 2:
            counts[out[1]] += 1
    total = counts.sum()
    expected = p2 * total
    mask = expected > 0
    assert counts[~mask].sum() == 0
    chi2 = float((((counts - expected) ** 2)[mask] / expected[mask]).sum())
    assert chi2 < 18.5, f"second token {counts.tolist()} vs expected {expected.tolist()} (chi2 {chi2:.1f})"


def test_verification_is_seed_reproducible() -> None:
    p, q = PAIRS["uniform draft"]
    rows = [VerifyRow(s, 3, [1, 2]) for s in range(50)]
    tp = torch.stack([p, p, p] * 50)
    dp = torch.stack([q, q] * 50)
    assert verify(tp, dp, rows) == verify(tp, dp, rows)
    # A request's result does not depend on its neighbours.
    assert verify(tp[3:6], dp[2:4], rows[1:2])[0] == verify(tp, dp, rows)[1]


def test_bad_arguments() -> None:
    p = torch.eye(V)[:2]
    with pytest.raises(ValueError, match="method"):
        verify(p, None, [VerifyRow(0, 0, [1])], "magic")
    with pytest.raises(ValueError, match="draft distributions"):
        verify(p, None, [VerifyRow(0, 0, [1])], "probabilistic")
    with pytest.raises(ValueError, match="rows"):
        verify(p, None, [VerifyRow(0, 0, [1, 2])], "strict")
    # A zero-draft request must not contribute a draft row: misaligned rows would bias every later request.
    with pytest.raises(ValueError, match="draft_probs has 2 rows, the drafts need 1"):
        verify(torch.eye(V)[:3], torch.eye(V)[:2], [VerifyRow(0, 0, []), VerifyRow(0, 0, [1])], "probabilistic")


# One ragged batch: request l verifies l drafts (l = 0..4), each position with its own (target, draft) pair.
# "disjoint supports" sits last in the requests that use it, so every position of every request is reached.
RAGGED_PAIRS: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {
    0: [],
    1: [PAIRS["peaked wrong draft"]],
    2: [PAIRS["uniform draft"], PAIRS["disjoint supports"]],
    3: [PAIRS["same"], (_dist(1, 4, 0, 2, 1, 0), _dist(2, 1, 1, 0, 1, 1)), PAIRS["uniform draft"]],
    4: [PAIRS["uniform draft"], PAIRS["same"], PAIRS["draft misses target tokens"], PAIRS["disjoint supports"]],
}
# The target's distribution at the bonus position of each request.
RAGGED_BONUS = {
    0: _dist(0, 1, 2, 3, 0, 1),
    1: _dist(2, 0, 0, 1, 1, 3),
    2: _dist(1, 1, 0, 0, 0, 0),  # never reached: its last draft is disjoint from the target
    3: _dist(0, 0, 3, 1, 0, 2),
    4: _dist(1, 0, 0, 0, 0, 1),  # never reached
}
# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def test_probabilistic_ragged_batch_every_position_has_the_target_distribution() -> None:
    """Requests verifying 0..4 drafts side by side in one call: at every position j of every request, the emitted
    token (given that position is emitted) is distributed as p_j, tokens with p_j = 0 never appear, and each draft
    is accepted with probability sum_x min(p_j(x), q_j(x)) (1 - total variation)."""
    n = 6000
    lengths = sorted(RAGGED_PAIRS)
    targets = {ell: [p for p, _ in RAGGED_PAIRS[ell]] + [RAGGED_BONUS[ell]] for ell in lengths}
    tp = torch.cat([torch.stack(targets[ell]) for ell in lengths])
    dp = torch.cat([torch.stack([q for _, q in RAGGED_PAIRS[ell]]) for ell in lengths if ell])
    counts = {ell: torch.zeros(ell + 1, V) for ell in lengths}
    for batch in range(n):
        rows = []
        for ell in lengths:
            seed, first = batch * 16 + ell, 3 * ell + batch % 5  # ragged counters too
            drafts = [inverse_cdf(q, uniform(seed, first + j, stream=7)) for j, (_, q) in enumerate(RAGGED_PAIRS[ell])]
            rows.append(VerifyRow(seed, first, drafts))
        out = verify(tp, dp, rows)
        for ell, row, emitted in zip(lengths, rows, out, strict=True):
            assert 1 <= len(emitted) <= ell + 1
            assert emitted[:-1] == row.draft_tokens[: len(emitted) - 1], "an emitted prefix differs from the drafts"
            for j, tok in enumerate(emitted):
                counts[ell][j, tok] += 1

    for ell in lengths:
        reached = counts[ell].sum(1)  # how often each position was emitted
        assert reached[0] == n
        for j in range(ell + 1):
            p = targets[ell][j]
            zero = p == 0
            assert counts[ell][j, zero].sum() == 0, f"l={ell}, position {j}: a token with p_j = 0 was emitted"
            if j < ell:  # position j + 1 is emitted exactly when draft j is accepted
                rate = min(1.0, float(torch.minimum(p, RAGGED_PAIRS[ell][j][1]).sum()))
                tried, went_on = float(reached[j]), float(reached[j + 1])
                sd = (tried * rate * (1 - rate)) ** 0.5
                assert abs(went_on - tried * rate) <= 4.5 * sd + 1e-6, (
                    f"l={ell}: draft {j} accepted {went_on:.0f} of {tried:.0f} times, expected rate {rate:.3f}"
                )
            total = float(reached[j])
            if total == 0:  # only behind a draft whose support is disjoint from the target's
                assert j >= 1 and float(torch.minimum(*RAGGED_PAIRS[ell][j - 1]).sum()) == 0
                continue
            assert total >= 500, f"l={ell}, position {j}: too few samples ({total:.0f}) for a chi-square test"
            expected = p * total
            chi2 = float((((counts[ell][j] - expected) ** 2)[~zero] / expected[~zero]).sum())
            df = int((~zero).sum()) - 1
            assert chi2 < CHI2_CRITICAL[df], (
                f"l={ell}, position {j}: emitted {counts[ell][j].tolist()} vs expected {expected.tolist()} "
                f"(chi2 {chi2:.1f}, df {df})"
            )
