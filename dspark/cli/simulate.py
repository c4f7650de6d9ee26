"""`dspark simulate`: replay a fixed-k draft trace under each verify policy and cost curve (bench/simulate.py)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from dspark.bench.simulate import CONCURRENCIES, curve_name, ema_study, load_cost, run_all
from dspark.bench.simulate_report import ema_table, markdown_table, plot, summary_line
from dspark.cli.common import Formatter
from dspark.errors import ConfigError
from dspark.speculative.trace import load_trace
from dspark.utils.results import output_path, write_json

SIMULATE_EPILOG = """\
The trace comes from the engine run with a fixed k and trace recording on. Each policy replays the same blocks;
a cell reads tokens/s (ratio to the oracle, which verifies exactly the drafts that survive).

examples:
  dspark simulate trace.jsonl
  dspark simulate trace.jsonl --cost b300 --cost cost-h200.json --output-json out/sim.json --output-plot out/sim.png
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="replay a draft trace under each verify policy and cost curve: tokens/s by concurrency",
        description="Trace-driven simulation of confidence-scheduled verification: no-spec, fixed k, adaptive\n"
        "(async and sync), threshold, SmartSpec-style and an oracle, on profiled or synthetic step costs.",
        epilog=SIMULATE_EPILOG,
        formatter_class=Formatter,
    )
    p.add_argument("trace", metavar="TRACE.jsonl", help="a step trace recorded by the engine")
    g = p.add_argument_group("simulation")
    g.add_argument(
        "--cost",
        action="append",
        metavar="CURVE",
        help="b300 (a synthetic B300-like curve) or a cost-model JSON from `dspark profile` (repeatable; "
        "default: b300)",
    )
    g.add_argument(
        "--concurrency",
        metavar="C",
        type=int,
        nargs="+",
        default=list(CONCURRENCIES),
        help="concurrencies to simulate (default: 1 2 4 ... 1024)",
    )
    g.add_argument(
        "--ema-alpha", metavar="A", type=float, default=0.8, help="confidence EMA, in [0, 1) (default: %(default)s)"
    )
    g.add_argument(
        "--threshold",
        metavar="TAU",
        type=float,
        default=0.5,
        help="the threshold policy verifies drafts whose survival is at least this (default: %(default)s)",
    )
    g.add_argument(
        "--steps", metavar="N", type=int, help="steps per run (default: enough for 2000 blocks, at least 20)"
    )
    g.add_argument("--output-json", metavar="PATH", help="write the rows and the EMA study here")
    g.add_argument("--output-plot", metavar="PATH", help="write the tokens/s plot here (PNG, SVG or PDF)")
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    if any(c < 1 for c in args.concurrency):
        raise ConfigError("concurrency", args.concurrency, "every value must be a positive integer")
    if not 0.0 <= args.ema_alpha < 1.0:
        raise ConfigError("ema_alpha", args.ema_alpha, "must be in [0, 1)")
    if not 0.0 < args.threshold <= 1.0:
        raise ConfigError("threshold", args.threshold, "must be in (0, 1]")
    if args.steps is not None and args.steps < 1:
        raise ConfigError("steps", args.steps, "must be a positive integer")
    output_json, output_plot = (
        output_path(args.output_json, "output_json"),
        output_path(args.output_plot, "output_plot"),
    )
    trace = load_trace(args.trace)
    specs = args.cost or ["b300"]
    curves = [(curve_name(spec), load_cost(spec)) for spec in specs]
    rows: list[dict[str, Any]] = []
    study: list[dict[str, Any]] = []
    for name, cost in curves:
        found = run_all(trace, cost, args.concurrency, args.ema_alpha, args.threshold, args.steps, progress=True)
        rows += [{"curve": name, **r} for r in found]
        study += [
            {"curve": name, **r} for r in ema_study(trace, cost, args.concurrency, steps=args.steps, progress=True)
        ]
    print(markdown_table(rows))
    print()
    print(ema_table(study))
    print()
    print(summary_line(rows))
    if output_json is not None:
        result = {
            "command": getattr(args, "command_line", ""),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "trace": {
                "path": str(args.trace),
                "header": trace.header,
                "num_streams": len(trace.streams),
                "num_blocks": trace.num_blocks,
                "num_censored": trace.num_censored,
            },
            "settings": {
                "costs": specs,
                "concurrencies": args.concurrency,
                "ema_alpha": args.ema_alpha,
                "threshold": args.threshold,
                "steps": args.steps,
            },
            "rows": rows,
            "ema_study": study,
        }
        write_json(output_json, result)
    if output_plot is not None:
        plot(rows, output_plot)
    return 0
