"""`dspark profile`: the step-cost curves adaptive verification plans with, as a table, a JSON and a plot.

The engine profiles them at start-up (worker/profiler.py) or loads them from the cache; this command builds the
engine for a speculative config, then shows what it would plan with: the profiled points and the curves between them
(step function up to the capture limit, linear above, monotone).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.speculative.cost_model import CostModel


def markdown_table(cost: CostModel) -> str:
    lines = ["| size | verify_ms (tokens) | draft_ms (requests) |", "|---:|---:|---:|"]
    for row in cost.table():
        v, d = row["verify_ms"], row["draft_ms"]
        lines.append(f"| {row['size']} | {'' if v != v else f'{v:.3f}'} | {'' if d != d else f'{d:.3f}'} |")
    return "\n".join(lines)


def plot(cost: CostModel, path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, curve, label in ((left, cost.verify, "target step (tokens)"), (right, cost.draft, "draft step (requests)")):
        top = max(curve.sizes) * 2
        n = torch.arange(1, top + 1)
        ax.plot(n.tolist(), curve(n).tolist(), label="model (used for planning)")
        ax.plot(curve.sizes, curve.ms, "o", label="profiled median")
        if curve.capture_limit:
            ax.axvline(curve.capture_limit, ls="--", color="grey", label="capture limit")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("ms")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
