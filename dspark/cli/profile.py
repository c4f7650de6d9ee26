"""`dspark profile`: the step-cost curves adaptive verification plans with, profiled (or the cached ones) and shown."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from dspark.cli.common import Formatter
from dspark.config import SpeculativeConfig
from dspark.engine.args import add_engine_args, engine_config
from dspark.utils.results import output_path

PROFILE_EPILOG = """\
examples:
  dspark profile --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' --output-plot cost.png
  dspark profile --speculative-config '{"method": "dspark", "model": "drafter/"}' --output-json cost.json --force
"""


def cmd_profile(args: argparse.Namespace) -> int:
    import os
    import tempfile

    from dspark.bench.profile import markdown_table, plot
    from dspark.engine.llm_engine import LLMEngine
    from dspark.worker.profiler import cost_model_path

    output, plot_path = output_path(args.output_json), output_path(args.output_plot, "output_plot")
    config = engine_config(args)
    spec = config.spec or SpeculativeConfig(method="ngram")
    config.speculative_config = dataclasses.replace(spec, enable_adaptive_verification=True)
    saved = os.environ.get("DSPARK_COST_MODELS")
    with tempfile.TemporaryDirectory() as fresh:
        if args.force:  # profile into an empty cache, then replace the cached profile with the new one
            os.environ["DSPARK_COST_MODELS"] = fresh
        try:
            engine = LLMEngine(config)
        finally:
            if args.force:
                os.environ.pop("DSPARK_COST_MODELS")
                if saved is not None:
                    os.environ["DSPARK_COST_MODELS"] = saved
    assert engine.planner is not None and engine.planner.cost is not None
    cost = engine.planner.cost
    cached = cost_model_path(cost.key)
    if args.force:
        cost.save(cached)
    print(markdown_table(cost))
    print(f"cached at {cached}")
    if output is not None:
        cost.save(output)
    if plot_path is not None:
        key = cost.key
        plot(cost, plot_path, f"{config.model} {key.get('dtype', '')} on {key.get('device', '')}, K={key.get('K')}")
    return 0


def add_parser(subparsers: Any) -> None:
    prof = subparsers.add_parser(
        "profile",
        help="profile (or show the cached) step-cost curves adaptive verification plans with",
        description="Build the engine with a speculative config (adaptive verification on), which profiles the target\n"
        "step by token count and the draft step by request count (or loads them from $DSPARK_CACHE/cost_models),\n"
        "then print the points and optionally write them as JSON and a plot.",
        epilog=PROFILE_EPILOG,
        formatter_class=Formatter,
    )
    g = prof.add_argument_group("profile")
    g.add_argument("--force", action="store_true", help="profile again even when a cached profile matches")
    g.add_argument("--output-json", metavar="PATH", help="write the cost model here (a file `dspark simulate` reads)")
    g.add_argument("--output-plot", metavar="PATH", help="write the curves here (PNG)")
    add_engine_args(prof)
    prof.set_defaults(func=cmd_profile)
