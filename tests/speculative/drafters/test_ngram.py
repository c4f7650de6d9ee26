"""Prompt-lookup drafting: longest match first, most recent occurrence, never past the end."""

from __future__ import annotations

import pytest

from dspark.speculative.drafters.ngram import NgramDrafter


def test_continues_the_most_recent_longest_match() -> None:
    d = NgramDrafter(min_n=1, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9  10 11
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 3, 6, 7]
    # Tail (6, 7) last occurred at 5-6, followed by 9, 2, 3, ...; the 3-gram (3, 6, 7) never occurred before.
    assert d.propose(tokens, 3) == [9, 2, 3]
    assert d.propose(tokens, 10) == [9, 2, 3, 6, 7]  # stops at the end of the sequence


def test_longer_match_beats_a_more_recent_shorter_one() -> None:
    d = NgramDrafter(min_n=1, max_n=2)
    tokens = [1, 2, 3, 9, 2, 4, 1, 2]
    # 2-gram (1, 2) occurred at 0-1 (then 3); the more recent 1-gram (2,) at 4 would give 4.
    assert d.propose(tokens, 2) == [3, 9]


def test_no_match_and_edge_cases() -> None:
    d = NgramDrafter(min_n=2, max_n=3)
    assert d.propose([1, 2, 3, 4], 4) == []  # no 2-gram repeats
    assert d.propose([7], 4) == []
    assert d.propose([], 4) == []
    assert d.propose([1, 2, 1, 2], 0) == []
    assert NgramDrafter(1, 1).propose([4, 4, 4], 5) == [4]  # (4,) at index 1 is followed by one token


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(min_n=0)
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(min_n=3, max_n=2)


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 1), (1, 4), (2, 3)])
def test_the_incremental_index_matches_the_full_scan(min_n: int, max_n: int) -> None:
    """Grown a few tokens at a time (as accepted drafts arrive), the index proposes what a full scan proposes."""
    import random

    from dspark.speculative.drafters.ngram import NgramIndex

    rng = random.Random(min_n * 10 + max_n)
    d = NgramDrafter(min_n, max_n)
    for _ in range(30):
        index, tokens = NgramIndex(d), []
        for _ in range(60):
            tokens += [rng.randrange(4) for _ in range(rng.randrange(1, 4))]  # a small alphabet: many repeats
            k = rng.randrange(0, 6)
            assert index.match(tokens, k) == d.match(tokens, k), tokens
    with pytest.raises(ValueError, match="shrank"):
        index.match(tokens[:-1], 3)
