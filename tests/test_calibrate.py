"""Sequential Temperature Scaling on synthetic drafts whose true acceptance is known."""

from __future__ import annotations

import torch

from dspark.train.calibrate import (
    calibrated_survival,
    expected_calibration_error,
    fit_sts,
    survival_outcomes,
)


def _synthetic(n: int, true_temps: list[float], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits, and how many drafts of each block survive when draft k survives with sigmoid(logit_k / T_k)."""
    g = torch.Generator().manual_seed(seed)
    k = len(true_temps)
    logits = torch.randn(n, k, generator=g, dtype=torch.float64) * 2 + 1
    p = torch.sigmoid(logits / torch.tensor(true_temps, dtype=torch.float64))
    alive = torch.rand(n, k, generator=g, dtype=torch.float64) < p
    num_accepted = torch.cumprod(alive.long(), dim=1).sum(1)
    return logits, num_accepted


def test_ece_of_perfect_and_of_wrong_predictions() -> None:
    assert expected_calibration_error(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])) == 0.0
    assert abs(expected_calibration_error(torch.full((10,), 0.9, dtype=torch.float64), torch.zeros(10)) - 0.9) < 1e-12
    # Two bins, each right on average: calibrated even though single predictions miss.
    pred = torch.tensor([0.25, 0.25, 0.25, 0.25, 0.75, 0.75, 0.75, 0.75])
    assert expected_calibration_error(pred, torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0])) < 1e-12


def test_survival_outcomes() -> None:
    assert survival_outcomes(torch.tensor([0, 2, 3]), 3).tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_sts_recovers_the_temperatures_and_calibrates_survival() -> None:
    true_temps = [0.5, 2.0, 1.0, 3.0]
    logits, accepted = _synthetic(40000, true_temps)
    survived = survival_outcomes(accepted, 4)
    temps = fit_sts(logits, survived)
    for got, want in zip(temps, true_temps, strict=True):
        assert abs(got / want - 1) < 0.15, (temps, true_temps)
    held_out_logits, held_out_accepted = _synthetic(40000, true_temps, seed=1)
    held_out = survival_outcomes(held_out_accepted, 4)
    before = calibrated_survival(held_out_logits, [1.0] * 4)
    after = calibrated_survival(held_out_logits, temps)
    for k in range(4):
        ece_before = expected_calibration_error(before[:, k], held_out[:, k])
        ece_after = expected_calibration_error(after[:, k], held_out[:, k])
        assert ece_after < 0.02 and ece_after <= ece_before, (k, ece_before, ece_after)


def test_sts_preserves_the_order_of_confidences_at_each_position() -> None:
    logits, accepted = _synthetic(5000, [0.7, 1.5])
    temps = fit_sts(logits, survival_outcomes(accepted, 2))
    a = calibrated_survival(logits, temps)
    c = torch.sigmoid(logits[:, 0])
    assert torch.equal(torch.argsort(a[:, 0]), torch.argsort(c))  # position 1: a monotone map of the raw confidence
    assert (a[:, 1] <= a[:, 0]).all()
