"""The graph runner's block-table staging (cuda_graphs.TableRows) rewrites only what changed since the last replay;
whatever the sequence of steps, the rows the attention reads must equal a full rewrite's."""

from __future__ import annotations

import random

import numpy as np

from dspark.worker.cuda_graphs import TableRows

MAX_BLOCKS = 12


def _read(host: np.ndarray, widths: list[int]) -> list[list[int]]:
    return [host[i, :w].tolist() for i, w in enumerate(widths)]


def test_staged_rows_equal_a_full_rewrite_through_growth_reordering_and_freeing() -> None:
    rng = random.Random(0)
    rows = TableRows(np.full((8, MAX_BLOCKS), -7, dtype=np.int32))
    next_block = iter(range(10_000))
    # request -> its block list (the object the engine holds; grown by append, replaced when freed)
    lists = {r: [next(next_block)] for r in range(12)}
    for step in range(400):
        batch = rng.sample(sorted(lists), rng.randint(1, 8))
        if step % 3:  # mostly the same order as the last step, as decoding keeps it
            batch.sort()
        for r in batch:
            if rng.random() < 0.3 and len(lists[r]) < MAX_BLOCKS:
                lists[r].append(next(next_block))
            if rng.random() < 0.03:  # freed (preempted or finished): a new list, with other blocks
                lists[r] = [next(next_block)]
        tables = [lists[r] for r in batch]
        widths = [rng.randint(1, len(b)) for b in tables]  # a row may read fewer blocks than it holds
        rows.stage(tables, widths)
        assert _read(rows.host, widths) == [b[:w] for b, w in zip(tables, widths, strict=True)]


def test_a_freed_request_with_as_many_blocks_is_rewritten() -> None:
    """The case an identity check on lengths alone would miss: the same row, a new list of the same length."""
    rows = TableRows(np.zeros((1, 4), dtype=np.int32))
    old = [5, 6]
    rows.stage([old], [2])
    new = [8, 9]
    rows.stage([new], [2])
    assert rows.host[0, :2].tolist() == [8, 9]
    new.append(10)
    rows.stage([new], [3])
    assert rows.host[0, :3].tolist() == [8, 9, 10]
