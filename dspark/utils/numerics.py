"""Row padding that keeps CPU matmuls batch-invariant.

CPU BLAS (oneDNN / MKL in torch's CPU builds) picks kernels by the number of rows M, and some of them order a row's
reduction differently: F.linear gives each row the same bits for M = 4, 8 and every M >= 12, but not for M in {1-3,
5-7, 9-11}; batched matmul agrees for every M >= 4 (tests/utils/test_numerics.py checks both on every run). Padding M
up to a multiple of 4 is therefore enough, and costs at most three rows.
"""

from __future__ import annotations

ROW_MULTIPLE = 4


def padded_rows(n: int) -> int:
    """The row count to compute n rows with: a multiple of ROW_MULTIPLE, at least ROW_MULTIPLE."""
    return max(ROW_MULTIPLE, -(-n // ROW_MULTIPLE) * ROW_MULTIPLE)


def rows_for(n: int, pad: bool) -> int:
    """The rows to compute n rows with: padded_rows(n) in batch-invariant mode (pad), n otherwise."""
    return padded_rows(n) if pad else n
