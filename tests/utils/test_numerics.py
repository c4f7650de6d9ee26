"""The BLAS facts batch invariance rests on (utils/numerics.py): if torch or the machine changes them, this fails
first, with the row counts that broke, instead of a distant batch-invariance test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.attention.torch_ref import MIN_ROWS
from dspark.utils.numerics import padded_rows


@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576), (64, 64)])
def test_linear_rows_are_invariant_at_padded_counts(shape: tuple[int, int]) -> None:
    n, k = shape
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(n, k, generator=g), torch.randn(160, k, generator=g)
    ref = F.linear(x, w)  # 160 rows
    bad = [m for m in range(1, 160) if not torch.equal(F.linear(x[: padded_rows(m)], w)[:m], ref[:m])]
    assert not bad, f"rows differ from a 160-row matmul when computing {bad} rows padded"


def test_batched_matmul_rows_are_invariant_from_min_rows() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 160, 64, generator=g), torch.randn(6, 64, 64, generator=g)
    ref = torch.matmul(a, b)
    bad = [m for m in range(MIN_ROWS, 160) if not torch.equal(torch.matmul(a[:, :m], b), ref[:, :m])]
    assert not bad, f"batched matmul rows differ for M in {bad}"


def test_padded_rows() -> None:
    assert [padded_rows(n) for n in (1, 3, 4, 5, 8, 9, 12, 13)] == [4, 4, 4, 8, 8, 12, 12, 16]


def test_mlp_and_norm_rows_are_invariant_with_many_threads() -> None:
    """The MLP (its activation is gate / (1 + exp(-gate))) and RMSNorm give a row the same bits at any padded batch
    size, also when torch splits element-wise loops over 8 threads (F.silu does not: see models/llama.py)."""
    from dspark.models.config import ModelConfig
    from dspark.models.llama import MLP, RMSNorm

    cfg = ModelConfig("llama", 64, 576, 1536, 1, 9, 3, 64, 1e-5, 1e4, 128, True, False, False)
    previous = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        torch.manual_seed(0)
        mlp, norm = MLP(cfg), RMSNorm(576, 1e-5)
        x = torch.randn(512, 576)
        with torch.no_grad():
            full_mlp, full_norm = mlp(x), norm(x)
            bad = [
                m
                for m in range(4, 512, 4)
                if not torch.equal(mlp(x[:m]), full_mlp[:m]) or not torch.equal(norm(x[:m]), full_norm[:m])
            ]
        assert not bad, f"rows differ at batch sizes {bad}"
    finally:
        torch.set_num_threads(previous)
