"""Evaluate a DSpark drafter: acceptance length tau at fixed k, per-position acceptance, survival calibration.

One engine runs every (dataset, temperature) row with k = the drafter's block size and adaptive verification off, and
records a trace (speculative/trace.py).
tau = 1 + accepted / drafts over a row's requests, vLLM's mean acceptance length.
The per-position rates and the calibration metrics use only the blocks whose K drafts were all verified (the rest
were cut short by max_tokens), so survival to every position is observed.

Calibration: the survivals a_k = prod_{i<=k} sigmoid(logit_i / T_i + b_i) against whether drafts 1..k all survived,
before (the head's raw logits, T = 1, b = 0) and after STS. The scaling "after" uses is fitted on held-out data
(prompts run through the same engine, or a trace recorded with this drafter), never on the rows it is scored on;
without held-out data it is the drafter's stored one. Both are tables of fits per sampling temperature
(speculative/calibration.py's StsTable): each row is scored with the scaling at its own temperature.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dspark.config import SamplingParams
from dspark.errors import ConfigError
from dspark.llm import LLM
from dspark.speculative.calibration import StsTable
from dspark.speculative.drafters.dspark.config import DSparkConfig
from dspark.speculative.trace import Block, Trace, load_trace
from dspark.train.calibrate import (
    NUM_BINS,
    calibrated_survival,
    expected_calibration_error,
    fit_by_temperature,
    logits_from_confidences,
    recorded_table,
    scaling_at,
    survival_outcomes,
)

Blocks = tuple[torch.Tensor, torch.Tensor]  # fully verified blocks: confidences [N, K], accepted drafts [N]
Scaling = tuple[list[float], list[float]]  # per-position STS temperatures and shifts


def _identity(k: int) -> Scaling:
    return [1.0] * k, [0.0] * k


def drafter_config(drafter_dir: str | Path) -> DSparkConfig:
    path = Path(drafter_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError("drafter_dir", str(drafter_dir), f"a DSpark drafter directory ({e})") from None
    return DSparkConfig.from_json(raw, str(path))


def fixed_k_llm(engine_args: dict[str, Any], drafter_dir: str | Path, trace_path: str | Path) -> LLM:
    """An engine that verifies all K = block size drafts every step and traces them."""
    spec = {
        "method": "dspark",
        "model": str(drafter_dir),
        "num_speculative_tokens": drafter_config(drafter_dir).block_size,
        "enable_adaptive_verification": False,
        "trace_path": str(trace_path),
    }
    return LLM(**{**engine_args, "speculative_config": spec})


def run_prompts(llm: LLM, prompts: list[str], temperature: float, max_tokens: int, progress: bool) -> dict[str, Any]:
    """Chat-templated prompts in one generate() call (the i-th prompt that fits seeded i); the counts tau is made of,
    and the ids."""
    ids = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    # Prompts with no room to generate in the context are skipped, not an error in the middle of an evaluation.
    kept = [i for i in ids if len(i) < llm.engine.max_model_len]
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i) for i in range(len(kept))]
    outputs = llm.generate(kept, params, use_tqdm=progress)
    drafts = sum(o.metrics.spec_num_drafts for o in outputs)
    accepted = sum(o.metrics.spec_num_accepted_tokens for o in outputs)
    return {
        "num_prompts": len(kept),
        "num_skipped": len(ids) - len(kept),
        "num_drafts": drafts,
        "num_accepted_tokens": accepted,
        "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "tau": 1 + accepted / drafts if drafts else 1.0,
        "request_ids": [o.request_id for o in outputs],
    }


def full_blocks(trace: Trace, request_ids: Sequence[str] | None = None) -> Blocks:
    """full blocks as tensors: their confidences [N, K] and accepted drafts [N]."""
    blocks = _trace_blocks(trace, request_ids)
    conf = torch.tensor([b.confidences for b in blocks], dtype=torch.float64).reshape(len(blocks), trace.K)
    return conf, torch.tensor([b.accepted for b in blocks], dtype=torch.long)


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """P(a positive outscores a negative), ties counting half (Mann-Whitney U from average ranks); None if one class
    is missing."""
    s, y = scores.double().flatten(), labels.flatten().bool()
    num_pos = int(y.sum())
    num_neg = y.numel() - num_pos
    if num_pos == 0 or num_neg == 0:
        return None
    _, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    ranks = (ends - (counts.double() - 1) / 2)[inverse]  # 1-based, tied scores share their mean rank
    return float((ranks[y].sum() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))


def acceptance(blocks: Blocks, k: int) -> dict[str, list[float | None]]:
    """Per position: P(draft k accepted | drafts 1..k-1 accepted), and P(drafts 1..k all accepted)."""
    survived = survival_outcomes(blocks[1], k)  # [N, K]
    reached = torch.cat([torch.tensor([float(len(survived))]), survived.sum(0)[:-1]])
    return {
        "accept_rate": [float(a / r) if r else None for a, r in zip(survived.sum(0), reached, strict=True)],
        "survival_rate": [float(v) for v in survived.mean(0)] if len(survived) else [None] * k,
    }


def calibration(blocks: Blocks, stored: Scaling, after: Scaling) -> dict[str, Any]:
    """ECE (20 bins), Brier and AUROC of the survivals over all (block, position) pairs, before and after STS."""
    k = len(stored[0])
    logits = logits_from_confidences(blocks[0], *stored)
    survived = survival_outcomes(blocks[1], k)
    out: dict[str, Any] = {"num_blocks": len(survived)}
    for name, scaling in (("before", _identity(k)), ("after", after)):
        p = calibrated_survival(logits, *scaling)
        empty = not p.numel()  # no fully verified block: nothing to score
        out[f"ece_{name}"] = None if empty else expected_calibration_error(p, survived)
        out[f"brier_{name}"] = None if empty else float(((p - survived) ** 2).mean())
        out[f"auroc_{name}"] = auroc(p, survived)
    return out


def _trace_blocks(trace: Trace, request_ids: Sequence[str] | None = None) -> list[Block]:
    """The trace's blocks with all K drafts verified (with fixed k every held draft is verified), of some requests."""
    keep = trace.streams.keys() if request_ids is None else request_ids
    return [b for rid in keep for b in trace.streams.get(rid, []) if b.num_drafts == trace.K]


def _fit(blocks: list[Block], trace: Trace, stored: StsTable, field: str, value: object) -> StsTable:
    """STS fitted on held-out blocks, per sampling temperature among them, into the stored table."""
    if not blocks:
        raise ConfigError(field, value, f"gave no block with all {trace.K} drafts verified: more prompts or tokens")
    return fit_by_temperature(blocks, trace.K, recorded_table(trace.header, stored), stored, 1.0)[0]


def evaluate_drafter(
    engine_args: dict[str, Any],
    drafter_dir: str | Path,
    datasets: dict[str, list[str]],
    temperatures: Sequence[float] = (1.0, 0.0),
    max_tokens: int = 256,
    calibration_prompts: list[str] | None = None,
    calibration_trace: str | Path | None = None,
    calibration_temperatures: Sequence[float] = (1.0,),
    trace_path: str | Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """One row per (dataset, temperature), a pooled calibration over the temperature-1 rows, and where the STS
    scaling came from. A row is scored with the scaling at its temperature: the drafter's stored one, with the fits
    on held-out data (at calibration_temperatures, or at those a calibration trace recorded) in its place.
    engine_args: LLM's keyword arguments (model, device, dtype, ...) but the speculative config."""
    if calibration_prompts is not None and calibration_trace is not None:
        raise ConfigError("calibration_trace", str(calibration_trace), "not together with calibration prompts")
    cfg = drafter_config(drafter_dir)
    k = cfg.block_size
    stored = cfg.sts_table
    source, after, num_fit = "stored", stored, 0
    if calibration_trace is not None:  # fitted first: a bad trace fails before the long run
        fit_trace = load_trace(calibration_trace)
        if fit_trace.K != k:
            raise ConfigError("calibration_trace", str(calibration_trace), f"recorded with K={fit_trace.K}, not {k}")
        fit_on = _trace_blocks(fit_trace)
        after = _fit(fit_on, fit_trace, stored, "calibration_trace", str(calibration_trace))
        source, num_fit = f"trace {calibration_trace}", len(fit_on)
    with tempfile.TemporaryDirectory() as tmp:
        trace_file = Path(trace_path or Path(tmp) / "trace.jsonl")
        llm = fixed_k_llm(engine_args, drafter_dir, trace_file)
        if calibration_prompts is not None:
            held_out = [
                rid
                for t in calibration_temperatures
                for rid in run_prompts(llm, calibration_prompts, t, max_tokens, progress)["request_ids"]
            ]
            cal_trace = load_trace(trace_file)
            fit_on = _trace_blocks(cal_trace, held_out)
            after = _fit(fit_on, cal_trace, stored, "calibration_prompts", f"<{len(calibration_prompts)} prompts>")
            source, num_fit = "held-out prompts", len(fit_on)
        runs = {}
        for name, prompts in datasets.items():
            for t in temperatures:
                runs[name, t] = run_prompts(llm, prompts, t, max_tokens, progress)
        trace = load_trace(trace_file)

    rows, pooled_ids = [], []
    for (name, t), run in runs.items():
        blocks = full_blocks(trace, run["request_ids"])
        scored = calibration(blocks, scaling_at(stored, t), scaling_at(after, t))
        rows.append({"dataset": name, "temperature": t, **acceptance(blocks, k), **scored})
        rows[-1].update({key: v for key, v in run.items() if key != "request_ids"})
        pooled_ids += run["request_ids"] if t == 1.0 else []
    pooled = full_blocks(trace, pooled_ids)
    at_1 = scaling_at(stored, 1.0), scaling_at(after, 1.0)
    return {
        "drafter": str(drafter_dir),
        "K": k,
        "max_tokens": max_tokens,
        "calibration": {
            "source": source,
            "num_blocks": num_fit,
            "stored": stored.to_json(),
            "fitted": after.to_json(),
        },
        "rows": rows,
        "pooled_temperature_1": {**acceptance(pooled, k), **calibration(pooled, *at_1)} if pooled_ids else None,
        "reliability": reliability(pooled, *at_1) if pooled_ids else None,
    }


def reliability(blocks: Blocks, stored: Scaling, after: Scaling) -> dict[str, Any]:
    """Per non-empty bin of predicted survival: mean predicted, observed frequency, count; before and after STS."""
    k = len(stored[0])
    logits = logits_from_confidences(blocks[0], *stored)
    survived = survival_outcomes(blocks[1], k).flatten()
    out: dict[str, Any] = {}
    for name, scaling in (("before", _identity(k)), ("after", after)):
        p = calibrated_survival(logits, *scaling).flatten()
        bins = (p * NUM_BINS).long().clamp(0, NUM_BINS - 1)
        counts = torch.bincount(bins, minlength=NUM_BINS).double()
        seen = counts > 0
        mean_p = torch.bincount(bins, weights=p, minlength=NUM_BINS)[seen] / counts[seen]
        freq = torch.bincount(bins, weights=survived, minlength=NUM_BINS)[seen] / counts[seen]
        out[name] = {"predicted": mean_p.tolist(), "observed": freq.tolist(), "count": counts[seen].long().tolist()}
    return out


def plot_reliability(result: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves, pooled = result["reliability"], result["pooled_temperature_1"]
    if curves is None:
        raise ConfigError("output_plot", str(path), "needs rows at temperature 1 (the plot pools those)")
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], ls="--", color="grey", lw=1, label="perfectly calibrated")
    for name, label in (("before", "before (T = 1)"), ("after", f"after ({result['calibration']['source']})")):
        c, ece = curves[name], pooled[f"ece_{name}"]
        ax.plot(c["predicted"], c["observed"], "o-", ms=3, label=f"{label}: ECE {'-' if ece is None else f'{ece:.1%}'}")
    ax.set_xlabel("predicted survival")
    ax.set_ylabel("observed survival frequency")
    ax.set_title(f"survival calibration, K={result['K']}, temperature 1", fontsize=9)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown_table(result: dict[str, Any]) -> str:
    """Rows as markdown: tau, conditional acceptance per position, ECE before/after, AUROC and Brier after."""

    def num(v: float | None, fmt: str = ".3f") -> str:
        return "-" if v is None else format(v, fmt)

    k = result["K"]
    head = ["dataset", "T", "prompts", "tau", *[f"a{i + 1}" for i in range(k)], "ECE before", "ECE after"]
    lines = ["| " + " | ".join([*head, "AUROC", "Brier"]) + " |", "|" + "---|" * (len(head) + 2)]
    for r in result["rows"]:
        cells = [r["dataset"], f"{r['temperature']:g}", str(r["num_prompts"]), num(r["tau"], ".2f")]
        cells += [num(a, ".2f") for a in r["accept_rate"]]
        cells += [num(r["ece_before"], ".1%"), num(r["ece_after"], ".1%"), num(r["auroc_after"]), num(r["brier_after"])]
        lines.append("| " + " | ".join(cells) + " |")
    cal = result["calibration"]
    lines.append(f"\nK={k}; a_k: P(draft k accepted | drafts 1..k-1 accepted); STS scaling from {cal['source']}")
    return "\n".join(lines)
