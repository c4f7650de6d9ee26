"""Sequential Temperature Scaling (STS): calibrate a drafter's confidences so their running products are survivals.

The scheduler needs a_k = prod_{i<=k} c_i to be the probability that drafts 1..k all survive verification. STS fits
one temperature per position, left to right: c_k = sigmoid(logit_k / T_k + b_k), with (T_k, b_k) chosen by grid
search to minimise the expected calibration error (ECE) of the cumulative product at position k on held-out drafts,
the earlier positions' already fixed. A positive temperature keeps each position's order of confidences.

The shift b_k extends the paper's temperature-only STS: a temperature cannot move a logit across 0, so a head that
says "more likely than not" where drafts survive 30% of the time (what a drafter trained on few sequences learns:
it is more confident on its training answers than on new ones) stays at >= 0.5 at any T. b_k = 0 recovers STS, and
within 0.2 points of the best ECE the smallest |b_k| is taken.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.speculative.calibration import NUM_BINS, StsEntry, StsTable
from dspark.speculative.drafters.dspark.config import DSparkConfig
from dspark.speculative.trace import Block

DEFAULT_GRID = torch.logspace(-1.0, 1.0, 81, dtype=torch.float64)  # T in [0.1, 10]
DEFAULT_BIAS_GRID = torch.arange(-60, 61, dtype=torch.float64) / 10  # b in [-6, 6], steps of 0.1 (0 exactly)
ECE_TOLERANCE = 0.002


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


def _ece_rows(predicted: torch.Tensor, outcome: torch.Tensor, num_bins: int = NUM_BINS) -> torch.Tensor:
    """expected_calibration_error of each row of predicted [R, N] against one outcome [N], in one pass."""
    r, n = predicted.shape
    if n == 0:
        return torch.zeros(r, dtype=torch.float64)
    bins = (predicted.double() * num_bins).long().clamp_(0, num_bins - 1)
    bins += torch.arange(r)[:, None] * num_bins
    gap = torch.bincount(bins.flatten(), weights=predicted.double().flatten(), minlength=r * num_bins)
    gap -= torch.bincount(bins.flatten(), weights=outcome.double().expand(r, n).flatten(), minlength=r * num_bins)
    return gap.view(r, num_bins).abs().sum(1) / n


def survival_outcomes(num_accepted: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[N] accepted drafts per verified block (all K verified) -> [N, K] 1.0 where drafts 1..k all survived."""
    return (torch.arange(num_positions)[None, :] < num_accepted[:, None]).double()


def fit_sts(
    logits: torch.Tensor,  # [N, K] confidence logits of held-out drafts
    survived: torch.Tensor,  # [N, K] 1.0 where drafts 1..k all survived (survival_outcomes)
    grid: torch.Tensor = DEFAULT_GRID,
    bias_grid: torch.Tensor = DEFAULT_BIAS_GRID,
) -> tuple[list[float], list[float]]:
    """Per-position temperatures T_1..T_K and shifts b_1..b_K, fitted left to right on the ECE of the running
    product."""
    z = logits.double()
    temps: list[float] = []
    biases: list[float] = []
    prefix = torch.ones(z.shape[0], dtype=torch.float64)  # survival up to the previous position, calibrated
    for k in range(z.shape[1]):
        scored = []  # (ece, T, b) of every grid point
        for t in grid.tolist():
            candidates = prefix[None, :] * torch.sigmoid(z[None, :, k] / t + bias_grid[:, None])  # [B, N]
            scored += zip(
                _ece_rows(candidates, survived[:, k]).tolist(), [t] * len(bias_grid), bias_grid.tolist(), strict=True
            )
        # The simplest scaling within ECE_TOLERANCE of the best: the smallest shift, then the lowest ECE. Sampling
        # noise alone would otherwise trade a little of T for a shift the data does not call for.
        best = min(e for e, _, _ in scored)
        _, t, b = min((abs(b), e, t, b) for e, t, b in scored if e <= best + ECE_TOLERANCE)[1:]
        temps.append(t)
        biases.append(b)
        prefix = prefix * torch.sigmoid(z[:, k] / t + b)
    return temps, biases


def calibrated_survival(
    logits: torch.Tensor, temperatures: list[float], biases: list[float] | None = None
) -> torch.Tensor:
    """[N, K] logits -> [N, K] survivals a_k = prod_{i<=k} sigmoid(logit_i / T_i + b_i)."""
    t = torch.tensor(temperatures, dtype=torch.float64)
    b = torch.tensor(biases or [0.0] * len(temperatures), dtype=torch.float64)
    return torch.cumprod(torch.sigmoid(logits.double() / t + b), dim=-1)


def logits_from_confidences(
    confidences: torch.Tensor, temperatures: list[float] | None = None, biases: list[float] | None = None
) -> torch.Tensor:
    """Invert the drafter's c = sigmoid(logit / T + b): recorded (calibrated) confidences -> the head's raw logits."""
    c = confidences.double().clamp(1e-12, 1 - 1e-12)
    k = c.shape[1]
    t = torch.tensor(temperatures or [1.0] * k, dtype=torch.float64)[:k]
    b = torch.tensor(biases or [0.0] * k, dtype=torch.float64)[:k]
    return (torch.logit(c) - b) * t


def scaling_at(table: StsTable, temperature: float) -> tuple[list[float], list[float]]:
    """The (temperatures, biases) a request at this sampling temperature is calibrated with."""
    inv, bias = table.at(np.array([temperature]))
    return (1.0 / inv[0]).tolist(), bias[0].tolist()


def recorded_table(header: dict[str, Any], stored: StsTable) -> StsTable:
    """The calibration a trace's confidences were recorded with: its header's sts_by_temperature, or in an older
    trace its sts_temperatures / sts_biases (null there: the identity); else the drafter's stored one."""
    if header.get("sts_by_temperature") is not None:
        return StsTable(
            [
                StsEntry(e["sampling_temperature"], tuple(e["temperatures"]), tuple(e["biases"]))
                for e in header["sts_by_temperature"]
            ]
        )
    if "sts_temperatures" in header:
        return StsTable.single(stored.num_positions, header["sts_temperatures"], header.get("sts_biases"))
    return stored


def raw_logits(blocks: list[Block], recorded: StsTable, default_temperature: float) -> torch.Tensor:
    """[N, K] confidence logits of fully verified blocks, each undone with the scaling of its request's temperature
    (blocks of a trace that did not record it: default_temperature)."""
    conf = torch.tensor([b.confidences for b in blocks], dtype=torch.float64)
    temps = np.array([default_temperature if b.temperature is None else b.temperature for b in blocks])
    inv, bias = recorded.at(temps)
    k = conf.shape[1]  # a trace may verify fewer drafts than the drafter's block size
    c = conf.clamp(1e-12, 1 - 1e-12)
    return (torch.logit(c) - torch.from_numpy(bias[:, :k])) / torch.from_numpy(inv[:, :k])


def fit_by_temperature(
    blocks: list[Block],
    k: int,
    recorded: StsTable,
    stored: StsTable,
    default_temperature: float,
    keep: bool = True,
) -> tuple[StsTable, list[dict[str, Any]]]:
    """STS fitted on fully verified blocks, once per sampling temperature among them: the stored table with those
    fits in (keep False: the fits alone), and per fit its blocks, scaling and ECE before (stored) and after."""
    logits = raw_logits(blocks, recorded, default_temperature)
    survived = survival_outcomes(torch.tensor([b.accepted for b in blocks]), k)
    temps_of = np.array([default_temperature if b.temperature is None else b.temperature for b in blocks])
    table, fits = stored if keep else None, []
    for t in sorted(set(temps_of.tolist())):
        rows = torch.from_numpy(temps_of == t)
        temps, biases = fit_sts(logits[rows], survived[rows])
        old_temps, old_biases = scaling_at(stored, t)
        before = calibrated_survival(logits[rows], old_temps[:k], old_biases[:k])
        after = calibrated_survival(logits[rows], temps, biases)
        # Positions past the blocks' K keep their scaling at this temperature.
        entry = StsEntry(t, tuple(temps + old_temps[k:]), tuple(biases + old_biases[k:]))
        table = StsTable([entry]) if table is None else table.with_entry(entry)
        fits.append(
            {
                "sampling_temperature": t,
                "num_blocks": int(rows.sum()),
                "temperatures": temps,
                "biases": biases,
                "ece_before": expected_calibration_error(before, survived[rows]),
                "ece_after": expected_calibration_error(after, survived[rows]),
            }
        )
    assert table is not None, "no blocks to fit on"
    return table, fits


def calibrate_drafter(trace_path: Path, drafter_dir: Path, default_temperature: float = 1.0) -> dict[str, object]:
    """Fit STS on the fully verified blocks of a fixed-k trace (held-out prompts, recorded with this drafter: its
    confidences and how many drafts survived), once per sampling temperature in the trace, store the fits in the
    drafter's config.json, and report the survival ECE before and after each. The recorded confidences are undone
    with the scaling the trace's header says they were recorded with (else the config's), so fitting twice on one
    trace gives the same result.

    A fit replaces the stored one at its temperature and keeps those at others: a drafter calibrated at T = 1 and
    then at T = 0 has both. A drafter never calibrated takes the fit for every temperature, and sts_temperatures /
    sts_biases stored alone count as a fit at T = 1 (what calibrate-drafter fitted before it kept several).
    Blocks from a trace that did not record their request's temperature count as at default_temperature."""
    from dspark.speculative.trace import load_trace

    trace = load_trace(trace_path)
    blocks = [b for stream in trace.streams.values() for b in stream if b.num_drafts == trace.K]
    if not blocks:
        raise ValueError(f"{trace_path}: no block with all {trace.K} drafts verified; record the trace with fixed k")
    config_path = drafter_dir / "config.json"
    config = json.loads(config_path.read_text())
    # Our checkpoints keep the drafter's own keys under "dspark_config"; a top-level key overrides it on load.
    nested = config.get("dspark_config") if isinstance(config.get("dspark_config"), dict) else None
    own = nested if nested is not None else config
    cfg = DSparkConfig.from_json(config, str(config_path))
    k, block_size = trace.K, cfg.block_size
    never_calibrated = cfg.sts_by_temperature is None and cfg.sts_temperatures is None and cfg.sts_biases is None
    stored = cfg.sts_table
    table, fits = fit_by_temperature(
        blocks, k, recorded_table(trace.header, stored), stored, default_temperature, keep=not never_calibrated
    )
    assert table.num_positions == block_size
    for key in ("sts_temperatures", "sts_biases", "sts_by_temperature"):
        config.pop(key, None)
        own.pop(key, None)
    if len(table.entries) == 1 and table.entries[0].sampling_temperature == 1.0:  # the plain keys' meaning
        own["sts_temperatures"], own["sts_biases"] = list(table.entries[0].temperatures), list(table.entries[0].biases)
    else:
        own["sts_by_temperature"] = table.to_json()
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return {"fits": fits, "sts_by_temperature": table.to_json()}
