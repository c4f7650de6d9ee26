"""`dspark bench sweep`: no speculation, fixed k and adaptive verification by concurrency and temperature, in one run
(bench/sweep.py runs it, bench/sweep_report.py reports it)."""

from __future__ import annotations

import argparse
from typing import Any

from dspark.bench.sweep import (
    ADAPTIVE_K,
    ARMS,
    CONCURRENCIES,
    DATA_DIR_ENV,
    HELD_PLAIN,
    HF_MAX_CONCURRENCY,
    MIN_PROMPTS,
    SYNC,
    TEMPERATURES,
    run_sweep,
)
from dspark.bench.sweep_report import markdown_table, summary_line, write_outputs
from dspark.cli.common import Formatter
from dspark.engine.args import add_engine_args, engine_config
from dspark.utils.results import output_path

SWEEP_EPILOG = """\
Concurrency C keeps at most C requests in one engine (built once per arm with max_num_seqs = the largest C); a row
runs --num-prompts prompts (default: max(2C, 16)), each exactly --output-len tokens (EOS ignored). The table's cells
are output tokens/s; the summary line reads:
  adaptive / max(no-spec, best fixed): median <x>, <lowest> (C, T) to <highest> (C, T) over <rows> rows; <shape>
With --hf, transformers' continuous batching runs the same prompts on the same weights (arm hf, at most C requests in
flight, at --hf-concurrency) and the summary adds no-spec / hf at each temperature's largest such C.
The prompts: GSM8K test questions, MT-bench first turns and HumanEval prompts interleaved, read from --data-dir, else
$DSPARK_DATA_DIR, else ../shared/data beside the checkout; the built-in set when none of them exists.

examples:
  dspark bench sweep --output-json out/sweep.json --output-plot out/sweep.png --output-md out/sweep.md
  dspark bench sweep --arm no-spec --arm fixed-3 --arm adaptive --concurrency 1 8 32 --temperature 0 \\
      --dataset-path gsm8k.jsonl --dataset-path mt-bench.jsonl --dataset-path humaneval.jsonl --repeats 3
  dspark bench sweep --speculative-config '{"method": "dspark", "model": "drafter/"}' --output-len 128
  dspark bench sweep --arm no-spec --concurrency 1 16 256 1024 --hf   # hf at C = 1, 16, 256
  dspark bench sweep --arm no-spec --arm adaptive --hf-concurrency 1 256 --data-dir ../shared/data
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sweep",
        help="no-spec, fixed k and adaptive verification (and transformers) by concurrency and temperature, in one run",
        description="Offline sweep: output tokens/s, acceptance length and drafts verified per request-step of each\n"
        "arm at each concurrency and temperature, on a fixed prompt set in a fixed order.",
        epilog=SWEEP_EPILOG,
        formatter_class=Formatter,
    )
    g = p.add_argument_group("sweep")
    g.add_argument(
        "--arm",
        action="append",
        metavar="ARM",
        help=f"no-spec, fixed-K, adaptive or {HELD_PLAIN} (adaptive's engine held to plain steps: the price of "
        f"keeping the drafter's context), each optionally with {SYNC} (async scheduling off, to measure its gain "
        f"in the same run) (repeatable; default: {' '.join(ARMS)}); the speculative arms use "
        f"--speculative-config's method (default: ngram); adaptive verifies up to its num_speculative_tokens, "
        f"else {ADAPTIVE_K}",
    )
    g.add_argument(
        "--concurrency",
        metavar="C",
        type=int,
        nargs="+",
        default=list(CONCURRENCIES),
        help=f"most requests in flight of each row (default: {' '.join(map(str, CONCURRENCIES))})",
    )
    g.add_argument(
        "--temperature",
        metavar="T",
        type=float,
        nargs="+",
        default=list(TEMPERATURES),
        help="temperatures to run; 0 is greedy and checks that every arm's outputs equal no-spec's (default: 1 0)",
    )
    g.add_argument("--num-prompts", metavar="N", type=int, help=f"prompts per row (default: max(W x C, {MIN_PROMPTS}))")
    g.add_argument(
        "--waves", metavar="W", type=int, default=2, help="without --num-prompts: W x C prompts per row (default: 2)"
    )
    g.add_argument(
        "--output-len",
        metavar="L",
        type=int,
        default=256,
        help="tokens generated per prompt, EOS ignored (default: %(default)s)",
    )
    g.add_argument(
        "--dataset-path",
        action="append",
        metavar="FILE.jsonl",
        help="JSON lines with 'prompt', 'turns' or 'question' (repeatable, files interleaved; default: the mix from "
        "--data-dir)",
    )
    g.add_argument(
        "--data-dir",
        metavar="DIR",
        help="a directory laid out as ../shared/data: the default prompts are its GSM8K test questions, MT-bench "
        f"first turns and HumanEval prompts, interleaved (default: ${DATA_DIR_ENV}, else ../shared/data beside the "
        "checkout if it exists, else the built-in prompts)",
    )
    g.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template (default: on)"
    )
    g.add_argument("--repeats", metavar="R", type=int, default=1, help="rounds, arms alternating (default: 1)")
    g.add_argument(
        "--interleave",
        action="store_true",
        help="build every arm's engine once (each with its share of --gpu-memory-utilization) and alternate the arms "
        "row by row, so that a slow stretch of the host falls on all arms alike (default: engines in turn, each "
        "running all its rows, rebuilt every round)",
    )
    g.add_argument(
        "--hf",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also run Hugging Face transformers' continuous batching on the same prompts and weights, as arm hf "
        "(default: off)",
    )
    g.add_argument(
        "--hf-concurrency",
        metavar="C",
        type=int,
        nargs="+",
        help=f"the hf arm's concurrencies, each one of --concurrency; implies --hf (default: those up to "
        f"{HF_MAX_CONCURRENCY})",
    )
    g.add_argument("--output-json", metavar="PATH", help="write the rows and the settings here")
    g.add_argument("--output-plot", metavar="PATH", help="write the throughput and verify-length plot here (PNG)")
    g.add_argument("--output-md", metavar="PATH", help="write the markdown table here")
    add_engine_args(p, max_num_seqs=False)
    p.set_defaults(func=cmd_bench_sweep)


def cmd_bench_sweep(args: argparse.Namespace) -> int:
    paths = [output_path(getattr(args, f), f) for f in ("output_json", "output_plot", "output_md")]
    sweep = run_sweep(
        engine_config(args),
        arms=args.arm,
        concurrencies=args.concurrency,
        temperatures=args.temperature,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        dataset_paths=args.dataset_path,
        data_dir=args.data_dir,
        chat=args.chat,
        repeats=args.repeats,
        hf=args.hf,
        hf_concurrencies=args.hf_concurrency,
        command=args.command_line,
        waves=args.waves,
        interleave=args.interleave,
    )
    write_outputs(sweep.result, *paths)
    print(markdown_table(sweep.result))
    print(summary_line(sweep.result))
    return 0
