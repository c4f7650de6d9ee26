"""Step-cost curves: a step function up to the capture limit, linear above, monotone, and a JSON round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark.speculative.cost_model import CostCurve, CostModel


def _at(curve: CostCurve, *n: int) -> list[float]:
    return curve(torch.tensor(n)).tolist()


def test_step_function_up_to_the_capture_limit_then_linear() -> None:
    curve = CostCurve(sizes=[1, 2, 4, 8, 16, 24, 48], ms=[1.0, 1.0, 2.0, 3.0, 5.0, 6.0, 9.0], capture_limit=16)
    assert _at(curve, 1, 3, 4, 5, 8, 9, 16) == [1.0, 2.0, 2.0, 3.0, 3.0, 5.0, 5.0]  # padded to the next size
    assert _at(curve, 20, 24, 36) == [5.5, 6.0, 7.5]  # interpolated above the limit
    assert _at(curve, 96) == [15.0]  # extrapolated past the last point with the last slope


def test_noisy_profiles_are_forced_monotone() -> None:
    curve = CostCurve(sizes=[1, 8, 16, 32, 64], ms=[3.0, 2.5, 4.0, 3.5, 6.0], capture_limit=8)
    n = torch.arange(1, 200)
    out = curve(n)
    assert (out[1:] >= out[:-1]).all()
    assert _at(curve, 1) == [2.75] and _at(curve, 8) == [2.75] and _at(curve, 32) == [3.75]  # violators pooled


def test_one_slow_profile_point_does_not_become_a_cliff() -> None:
    """A profile whose 12 and 16 tokens hit a slow patch (eager): a running maximum would price every step
    above 12 tokens at 53 ms; the isotonic fit prices the flat region near its level."""
    sizes = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    ms = [31.7, 30.1, 28.2, 29.5, 28.0, 33.4, 53.3, 53.5, 27.7, 27.8, 28.2, 27.9, 27.8, 28.6]
    curve = CostCurve(sizes, ms, capture_limit=0)
    out = curve(torch.tensor(sizes))
    assert (out[1:] >= out[:-1]).all()
    assert float(out[-1]) < 36.0 and float(out[0]) > 28.0


def test_without_a_capture_limit_and_with_one_point() -> None:
    curve = CostCurve(sizes=[4, 8], ms=[2.0, 4.0])
    assert _at(curve, 1, 6, 16) == [2.0, 3.0, 8.0]  # never cheaper than the first profiled size
    assert _at(CostCurve(sizes=[10], ms=[5.0]), 5, 20) == [5.0, 10.0]


@pytest.mark.parametrize(
    ("sizes", "ms", "limit", "problem"),
    [
        ([], [], 0, "one time per size"),
        ([1, 2], [1.0], 0, "one time per size"),
        ([2, 2], [1.0, 1.0], 0, "strictly increasing"),
        ([0, 2], [1.0, 1.0], 0, "positive"),
        ([1, 2, 4], [1.0, 1.0, 1.0], 3, "must be a profiled size"),
    ],
)
def test_bad_curves(sizes: list[int], ms: list[float], limit: int, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        CostCurve(sizes, ms, limit)


def test_json_round_trip_is_keyed(tmp_path: Path) -> None:
    key = {"model": "m", "device": "cpu", "dtype": "float32", "k": 7, "grid": [1, 2, 4]}
    model = CostModel(CostCurve([1, 2, 4], [1.0, 2.0, 3.0], 4), CostCurve([1, 8], [0.5, 1.5]), key)
    path = tmp_path / "cost.json"
    model.save(path)
    loaded = CostModel.load(path, key)
    assert loaded is not None
    n = torch.arange(1, 20)
    assert torch.equal(loaded.verify_ms(n), model.verify_ms(n))
    assert loaded.draft_ms(5) == model.draft_ms(5) and model.draft_ms(0) == 0.0
    assert CostModel.load(path, {**key, "k": 5}) is None  # profiled for another K: stale
    path.write_text("{not json")
    assert CostModel.load(path, key) is None
    assert CostModel.load(tmp_path / "missing.json", key) is None


def _torch_curve(curve: CostCurve, n: torch.Tensor) -> torch.Tensor:
    """The curve in torch tensor ops (what ran before the numpy version): the reference."""
    sizes = torch.tensor(curve.sizes, dtype=torch.float64)
    ms = torch.tensor(curve.monotone_ms, dtype=torch.float64)
    x = n.to(torch.float64)
    above = torch.searchsorted(sizes, x).clamp(max=len(curve.sizes) - 1)
    if len(curve.sizes) == 1:
        linear = ms[0] * x / sizes[0]
    else:
        hi = above.clamp(min=1)
        lo = hi - 1
        linear = ms[lo] + (ms[hi] - ms[lo]) / (sizes[hi] - sizes[lo]) * (x - sizes[lo])
    return torch.where(x <= curve.capture_limit, ms[above], linear).clamp(min=float(ms[0]))


def test_the_numpy_curve_is_the_torch_one_bit_for_bit() -> None:
    """The curve runs in numpy for speed (the budget choice evaluates it at every candidate budget); its values are
    the torch formula's, bit for bit, for any input dtype, and a 0-d input gives a 0-d tensor."""
    gen = torch.Generator().manual_seed(5)
    for trial in range(200):
        num_points = 1 + trial % 6
        sizes = sorted(set(torch.randint(1, 4096, (num_points,), generator=gen).tolist()))
        ms = (torch.rand(len(sizes), generator=gen) * 10).tolist()
        limit = sizes[trial % len(sizes)] if trial % 3 else 0
        curve = CostCurve(sizes=sizes, ms=ms, capture_limit=limit)
        n = torch.randint(0, 9000, (50,), generator=gen)
        for x in (n, n.to(torch.int32), n.float(), n.double()):
            got = curve(x)
            assert got.dtype == torch.float64
            assert torch.equal(got, _torch_curve(curve, x)), (trial, x.dtype)
    scalar = CostCurve(sizes=[1, 8], ms=[1.0, 2.0])(torch.tensor(4))
    assert scalar.shape == () and float(scalar) == pytest.approx(1.0 + 3 / 7)
