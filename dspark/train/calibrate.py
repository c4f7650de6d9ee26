"""Sequential Temperature Scaling (STS): calibrate a drafter's confidences so their running products are survivals.

The scheduler needs a_k = prod_{i<=k} c_i to be the probability that drafts 1..k all survive verification. STS fits
one temperature per position, left to right: c_k = sigmoid(logit_k / T_k), with T_k chosen by grid search to minimise
the expected calibration error (ECE) of the cumulative product at position k on held-out drafts, the earlier
positions' temperatures already fixed. A positive temperature keeps each position's order of confidences.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

DEFAULT_GRID = torch.logspace(-1.0, 1.0, 81, dtype=torch.float64)  # T in [0.1, 10]
NUM_BINS = 20


def expected_calibration_error(predicted: torch.Tensor, outcome: torch.Tensor, num_bins: int = NUM_BINS) -> float:
    """ECE with equal-width bins: sum over bins of |mean predicted - mean outcome| weighted by the bin's share."""
    p = predicted.double().flatten()
    y = outcome.double().flatten()
    if p.numel() == 0:
        return 0.0
    bins = (p * num_bins).long().clamp_(0, num_bins - 1)
    counts = torch.bincount(bins, minlength=num_bins).double()
    gap = torch.bincount(bins, weights=p, minlength=num_bins) - torch.bincount(bins, weights=y, minlength=num_bins)
    return float(gap.abs().sum() / counts.sum())


def survival_outcomes(num_accepted: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[N] accepted drafts per verified block (all K verified) -> [N, K] 1.0 where drafts 1..k all survived."""
    return (torch.arange(num_positions)[None, :] < num_accepted[:, None]).double()


def fit_sts(
    logits: torch.Tensor,  # [N, K] confidence logits of held-out drafts
    survived: torch.Tensor,  # [N, K] 1.0 where drafts 1..k all survived (survival_outcomes)
    grid: torch.Tensor = DEFAULT_GRID,
) -> list[float]:
    """Per-position temperatures T_1..T_K, fitted left to right on the ECE of the running product."""
    z = logits.double()
    temps: list[float] = []
    prefix = torch.ones(z.shape[0], dtype=torch.float64)  # survival up to the previous position, calibrated
    for k in range(z.shape[1]):
        candidates = prefix[None, :] * torch.sigmoid(z[None, :, k] / grid[:, None])  # [G, N]
        errors = [expected_calibration_error(c, survived[:, k]) for c in candidates]
        best = min(range(len(errors)), key=lambda i: (errors[i], abs(float(grid[i]) - 1.0)))  # ties: nearest T=1
        temps.append(float(grid[best]))
        prefix = candidates[best]
    return temps


def calibrated_survival(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """[N, K] logits -> [N, K] survivals a_k = prod_{i<=k} sigmoid(logit_i / T_i)."""
    t = torch.tensor(temperatures, dtype=torch.float64)
    return torch.cumprod(torch.sigmoid(logits.double() / t), dim=-1)


def logits_from_confidences(confidences: torch.Tensor, temperatures: list[float] | None = None) -> torch.Tensor:
    """Invert the drafter's c = sigmoid(logit / T): recorded (calibrated) confidences -> the head's raw logits."""
    c = confidences.double().clamp(1e-12, 1 - 1e-12)
    t = torch.tensor(temperatures or [1.0] * c.shape[1], dtype=torch.float64)[: c.shape[1]]
    return torch.logit(c) * t


def calibrate_drafter(trace_path: Path, drafter_dir: Path) -> dict[str, object]:
    """Fit STS on the fully verified blocks of a fixed-k trace (held-out prompts, recorded with this drafter: its
    confidences and how many drafts survived), store the temperatures in the drafter's config.json, and report the
    survival ECE before and after."""
    from dspark.bench.simulate import load_trace

    trace = load_trace(trace_path)
    blocks = [b for stream in trace.streams.values() for b in stream if b.num_drafts == trace.K]
    if not blocks:
        raise ValueError(f"{trace_path}: no block with all {trace.K} drafts verified; record the trace with fixed k")
    config_path = drafter_dir / "config.json"
    config = json.loads(config_path.read_text())
    # Our checkpoints keep the drafter's own keys under "dspark_config"; a top-level key overrides it on load.
    nested = config.get("dspark_config") if isinstance(config.get("dspark_config"), dict) else None
    old = config.get("sts_temperatures", (nested or {}).get("sts_temperatures"))
    block_size = int(config.get("block_size", trace.K))
    conf = torch.tensor([b.confidences for b in blocks], dtype=torch.float64)
    logits = logits_from_confidences(conf, old)
    survived = survival_outcomes(torch.tensor([b.accepted for b in blocks]), trace.K)
    temps = fit_sts(logits, survived)
    before = expected_calibration_error(calibrated_survival(logits, (old or [1.0] * block_size)[: trace.K]), survived)
    after = expected_calibration_error(calibrated_survival(logits, temps), survived)
    # Positions past the trace's K keep their temperature (1 if none was fitted before).
    config.pop("sts_temperatures", None)
    (nested if nested is not None else config)["sts_temperatures"] = temps + list(
        (old or [1.0] * block_size)[trace.K :]
    )
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return {"num_blocks": len(blocks), "temperatures": temps, "ece_before": before, "ece_after": after}
