"""The report of `dspark bench sweep`: the ratios of its rows (adaptive against the best baseline arm, paired by round,
no-spec against transformers), the markdown table, the summary line, the plot, and the files they go to."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from dspark.bench.sweep import HF, parse_arm
from dspark.utils.results import write_json, write_text


def _by_row(result: dict[str, Any]) -> dict[tuple[float, int], dict[str, dict[str, Any]]]:
    """(temperature, concurrency) -> arm -> row."""
    table: dict[tuple[float, int], dict[str, dict[str, Any]]] = {}
    for row in result["rows"]:
        table.setdefault((row["temperature"], row["concurrency"]), {})[row["arm"]] = row
    return table


def adaptive_ratio(arms: dict[str, dict[str, Any]]) -> float | None:
    """Adaptive's output throughput over the best of no-spec and the fixed arms; None without both sides."""
    baseline = [r["output_throughput"] for name, r in arms.items() if name == "no-spec" or name.startswith("fixed-")]
    if "adaptive" not in arms or not baseline:
        return None
    return arms["adaptive"]["output_throughput"] / max(baseline)


def paired_adaptive_ratio(arms: dict[str, dict[str, Any]]) -> float | None:
    """The median over rounds of adaptive's throughput over the best baseline arm's in the same round; None without
    both sides or with one round. Under --interleave a round's rows of one concurrency run back to back, so a
    slow stretch of the host falls on both sides of each ratio; the ratio of medians can pair a slow round of one arm
    with a fast one of another."""
    baseline = [r for name, r in arms.items() if name == "no-spec" or name.startswith("fixed-")]
    if "adaptive" not in arms or not baseline:
        return None
    mine = arms["adaptive"]["rounds_output_throughput"]
    others = [r["rounds_output_throughput"] for r in baseline]
    if len(mine) < 2 or any(len(o) != len(mine) for o in others):
        return None
    return statistics.median(a / max(o[i] for o in others) for i, a in enumerate(mine))


def paired_ratio(arms: dict[str, dict[str, Any]], a: str, b: str) -> float | None:
    """The median over rounds of arm a's throughput over arm b's in the same round; None without both sides or with
    one round."""
    if a not in arms or b not in arms:
        return None
    xs, ys = arms[a]["rounds_output_throughput"], arms[b]["rounds_output_throughput"]
    if len(xs) < 2 or len(xs) != len(ys):
        return None
    return statistics.median(x / y for x, y in zip(xs, ys, strict=True))


def adaptive_over_no_spec(arms: dict[str, dict[str, Any]]) -> float | None:
    return paired_ratio(arms, "adaptive", "no-spec")


def adaptive_over_fixed(arms: dict[str, dict[str, Any]]) -> float | None:
    """Adaptive against its worst match among the fixed-k arms: the smallest paired ratio."""
    ratios = [
        r for name in arms if name.startswith("fixed-") and (r := paired_ratio(arms, "adaptive", name)) is not None
    ]
    return min(ratios) if ratios else None


def step_ms(arm: str):
    """A column: the arm's decode step, median wall ms / device ms."""

    def cell(arms: dict[str, dict[str, Any]]) -> str | None:
        row = arms.get(arm)
        if row is None or row.get("step_wall_ms") is None:
            return None
        device = row.get("step_device_ms")
        return f"{row['step_wall_ms']:.2f} / {device:.2f}" if device is not None else f"{row['step_wall_ms']:.2f} / -"

    return cell


def hf_ratio(arms: dict[str, dict[str, Any]]) -> float | None:
    """No-spec's output throughput over transformers' (the project's target: >= 20x at C = 256); None without both."""
    if "no-spec" not in arms or HF not in arms:
        return None
    return arms["no-spec"]["output_throughput"] / arms[HF]["output_throughput"]


def markdown_table(result: dict[str, Any]) -> str:
    arms = list(result["config"]["arms"])
    table = _by_row(result)
    ratios = [
        (head, fn)
        for head, fn in (
            ("adaptive / max(no-spec, best fixed)", adaptive_ratio),
            ("paired by round (median)", paired_adaptive_ratio),
            ("adaptive / no-spec, paired", adaptive_over_no_spec),
            ("adaptive / worst-matched fixed, paired", adaptive_over_fixed),
            ("no-spec / hf", hf_ratio),
        )
        if any(fn(a) is not None for a in table.values())
    ]
    steps = [(f"{a} step wall / device ms", step_ms(a)) for a in ("no-spec", "fixed-7") if a in arms]
    steps = [(h, fn) for h, fn in steps if any(fn(a) is not None for a in table.values())]
    head = ["T", "C", *(f"{a} tok/s" for a in arms), *(h for h, _ in ratios), *(h for h, _ in steps)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for (t, c), by_arm in table.items():
        cells = [f"{t:g}", str(c), *(f"{by_arm[a]['output_throughput']:.1f}" if a in by_arm else "-" for a in arms)]
        cells += ["-" if (ratio := fn(by_arm)) is None else f"{ratio:.2f}x" for _, fn in ratios]
        cells += [fn(by_arm) or "-" for _, fn in steps]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_line(result: dict[str, Any]) -> str:
    table = _by_row(result)
    cfg = result["config"]
    shape = (
        f"{len(cfg['arms'])} arms x {len(cfg['concurrencies'])} concurrencies x {len(cfg['temperatures'])} "
        f"temperatures, {cfg['output_len']} tokens per request, {result['dtype']} on {result['machine']['device_name']}"
    )
    # no-spec / hf at each temperature's largest concurrency where both ran
    hf_ratios = {}
    for (t, c), arms in sorted(table.items(), key=lambda kv: kv[0][1]):
        if (ratio := hf_ratio(arms)) is not None:
            hf_ratios[t] = f"{ratio:.2f}x (C={c}, T={t:g})"
    if hf_ratios:
        shape = f"no-spec / hf: {', '.join(hf_ratios.values())}; {shape}"
    ratios = {key: r for key, arms in table.items() if (r := adaptive_ratio(arms)) is not None}
    if ratios:
        (t_lo, c_lo), (t_hi, c_hi) = min(ratios, key=ratios.__getitem__), max(ratios, key=ratios.__getitem__)
        return (
            f"adaptive / max(no-spec, best fixed): median {statistics.median(ratios.values()):.2f}x, "
            f"{ratios[t_lo, c_lo]:.2f}x (C={c_lo}, T={t_lo:g}) to {ratios[t_hi, c_hi]:.2f}x (C={c_hi}, T={t_hi:g}) "
            f"over {len(ratios)} rows; {shape}"
        )
    wins: dict[str, int] = {}
    for arms in table.values():
        best = max(arms.values(), key=lambda r: r["output_throughput"])["arm"]
        wins[best] = wins.get(best, 0) + 1
    return f"fastest arm: {', '.join(f'{a} in {n}/{len(table)} rows' for a, n in wins.items())}; {shape}"


def plot(result: dict[str, Any], path: Path) -> None:
    """Output throughput by concurrency per arm, hf dashed (top), and drafts verified per request-step of the
    speculative arms (bottom), one column of panels per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms, temps = list(result["config"]["arms"]), result["config"]["temperatures"]
    fig, axes = plt.subplots(2, len(temps), figsize=(5.5 * len(temps), 7.5), squeeze=False, sharex=True)
    for j, t in enumerate(temps):
        top, bottom = axes[0][j], axes[1][j]
        for i, arm in enumerate(arms):
            rows = [r for r in result["rows"] if r["arm"] == arm and r["temperature"] == t]
            xs = [r["concurrency"] for r in rows]
            style = "s--" if arm == HF else "o-"
            top.plot(xs, [r["output_throughput"] for r in rows], style, color=f"C{i}", label=arm)
            if arm != HF and parse_arm(arm).speculates:
                bottom.plot(xs, [r["mean_verify_len"] for r in rows], "o-", color=f"C{i}", label=arm)
        top.set_title(f"temperature {t:g}")
        top.set_ylabel("output tokens/s")
        bottom.set_ylabel("drafts verified per request-step")
        bottom.set_xlabel("concurrency (requests in flight)")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(result["config"]["concurrencies"], [str(c) for c in result["config"]["concurrencies"]])
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # the bottom panel is empty without speculative arms
                ax.legend(fontsize=8)
    fig.suptitle(f"{result['config']['model']}, {result['dtype']} on {result['machine']['device_name']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(result: dict[str, Any], json_path: Path | None, plot_path: Path | None, md_path: Path | None) -> None:
    write_json(json_path, result)
    if plot_path is not None:
        plot(result, plot_path)
    if md_path is not None:
        write_text(md_path, markdown_table(result) + "\n\n" + summary_line(result) + "\n", "output_md")
