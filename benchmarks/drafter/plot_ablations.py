"""Per-position conditional acceptance of the ablation drafters (Markov head off, rank 32, rank 64; 1-3 layers), from
the eval-drafter JSON files in benchmarks/results/drafter/h200/. Usage: python benchmarks/drafter/plot_ablations.py"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1] / "results" / "drafter" / "h200"
ARMS = {
    "l2-r0": "2 layers, no Markov head",
    "l2-r32": "2 layers, Markov rank 32",
    "l2-r64": "2 layers, Markov rank 64",
    "l1-r32": "1 layer, rank 32",
    "l3-r32": "3 layers, rank 32",
}


def main() -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for name, label in ARMS.items():
        pooled = json.loads((ROOT / f"ablation-{name}.json").read_text())["pooled_temperature_1"]
        rates = pooled["accept_rate"][:5]  # later positions rest on a few dozen blocks
        style = "-" if name.startswith("l2") else ":"
        ax.plot(range(1, len(rates) + 1), rates, style, marker="o", ms=3, label=label)
    ax.set_xticks(range(1, 6))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(draft k accepted | 1..k-1 accepted)")
    ax.set_title("SmolLM2 ablation drafters, T = 1, k = 7 (H200; 60 s of training each)", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ROOT / "ablation-per-position.png", dpi=110)


if __name__ == "__main__":
    main()
