"""The report of `dspark simulate`: tokens/s per policy by cost curve and concurrency, the EMA study, the summary
line and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _shown_policies(rows: list[dict[str, Any]]) -> list[str]:
    """The policies worth a column or a line: fixed-K only as its largest k, beside the best fixed k."""
    names = list(dict.fromkeys(r["policy"] for r in rows))
    fixed = [n for n in names if n.startswith("fixed-")]
    top = max(fixed, key=lambda n: int(n.removeprefix("fixed-")), default=None)
    return [n for n in names if not n.startswith("fixed-") or n == top]


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, dict[str, Any]]]:
    groups: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r.get("curve", ""), r["concurrency"]), {})[r["policy"]] = r
    return groups


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Tokens/s per policy (ratio to the oracle in brackets) by curve and concurrency, with adaptive-async's mean
    verify length and predicted minus realised accepted drafts per verified block."""
    shown = _shown_policies(rows)
    head = ["curve", "C", *shown, "best k", "async verify len", "async pred-real"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for (curve, c), by_policy in _groups(rows).items():
        cells = [curve or "-", str(c)]
        for name in shown:
            r = by_policy.get(name)
            cells.append(f"{r['tokens_per_s']:,.0f} ({r['ratio_to_oracle']:.2f})" if r else "-")
        best, adaptive = by_policy.get("best-fixed"), by_policy.get("adaptive-async")
        cells.append(str(best["k"]) if best else "-")
        cells.append(f"{adaptive['mean_verify_len']:.2f}" if adaptive else "-")
        pmr = adaptive["pred_minus_real"] if adaptive else None
        cells.append(f"{pmr:+.3f}" if pmr is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ema_table(study: list[dict[str, Any]]) -> str:
    """adaptive-async's predicted minus realised accepted drafts per verified draft: one row per curve and alpha."""
    concurrencies = list(dict.fromkeys(r["concurrency"] for r in study))
    by_row: dict[tuple[str, float], dict[int, float | None]] = {}
    for r in study:
        by_row.setdefault((r.get("curve", ""), r["alpha"]), {})[r["concurrency"]] = r["pred_minus_real_per_draft"]
    head = ["curve", "alpha", *(f"C={c}" for c in concurrencies)]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for (curve, alpha), values in by_row.items():
        cells = [f"{v:+.3f}" if v is not None else "-" for v in (values.get(c) for c in concurrencies)]
        lines.append("| " + " | ".join([curve or "-", f"{alpha:g}", *cells]) + " |")
    return "\n".join(lines)


def summary_line(rows: list[dict[str, Any]]) -> str:
    parts = []
    for curve in dict.fromkeys(r.get("curve", "") for r in rows):
        groups = [g for (cv, _), g in _groups(rows).items() if cv == curve]
        ratios = [g["adaptive-async"]["ratio_to_oracle"] for g in groups]
        wins = sum(g["adaptive-async"]["tokens_per_s"] >= g["best-fixed"]["tokens_per_s"] for g in groups)
        parts.append(
            f"{curve or 'cost'}: adaptive-async at {min(ratios):.2f}-{max(ratios):.2f} of the oracle, "
            f">= the best fixed k at {wins}/{len(groups)} concurrencies"
        )
    return "; ".join(parts)


def plot(rows: list[dict[str, Any]], path: str | Path) -> None:
    """Tokens/s (top) and its ratio to the oracle (bottom) against concurrency, one column per cost curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = list(dict.fromkeys(r.get("curve", "") for r in rows))
    fig, axes = plt.subplots(2, len(curves), figsize=(6.5 * len(curves), 8), squeeze=False, sharex=True)
    for col, curve in enumerate(curves):
        sub = [r for r in rows if r.get("curve", "") == curve]
        top, bottom = axes[0][col], axes[1][col]
        for name in _shown_policies(sub):
            points = sorted(
                (r["concurrency"], r["tokens_per_s"], r["ratio_to_oracle"]) for r in sub if r["policy"] == name
            )
            style = {"linestyle": "--" if name in ("oracle", "no-spec") else "-", "marker": "o", "markersize": 3}
            top.plot([p[0] for p in points], [p[1] for p in points], label=name, **style)
            bottom.plot([p[0] for p in points], [p[2] for p in points], label=name, **style)
        top.set_title(f"cost curve: {curve}" if curve else "simulated throughput")
        top.set_ylabel("tokens/s")
        top.set_yscale("log")
        bottom.set_ylabel("tokens/s relative to the oracle")
        bottom.set_xlabel("concurrency")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
