"""`dspark train-drafter`, `dspark calibrate-drafter` and `dspark eval-drafter`: a DSpark drafter trained for the model,
its confidences calibrated on held-out data, and its acceptance and calibration measured per dataset."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from dspark.cli.common import Formatter, load_llm, tty
from dspark.engine.args import add_engine_args, engine_config
from dspark.errors import ConfigError, DSparkError
from dspark.utils.jsonl import read_jsonl_prompts
from dspark.utils.results import output_path, write_json

TRAIN_EPILOG = """\
examples:
  dspark train-drafter --data-dir ../shared/data --output-dir runs/smollm2 --steps 4000 --device cuda
  dspark train-drafter --data-dir ../shared/data --output-dir runs/smollm2 --steps 8000   # resume, train longer
  dspark train-drafter --data-dir ../shared/data --output-dir runs/tuned --init-from dspark/assets/smollm2-135m-dspark \
      --lr 3e-4 --steps 1000   # fine-tune the shipped drafter
  python benchmarks/drafter/merge_data.py runs/big/sequences.npz shard-*.npz   # answers made beforehand, then:
  dspark train-drafter --data-dir ../shared/data --output-dir runs/big --batch-size 64 --device cuda --dtype bfloat16
"""


CALIBRATE_EPILOG = """\
examples:
  dspark calibrate-drafter runs/smollm2/drafter --dataset held_out.jsonl --num-prompts 200 --device cuda
  dspark calibrate-drafter runs/smollm2/drafter --dataset held_out.jsonl --temperature 0 1   # greedy and sampled
  dspark calibrate-drafter runs/smollm2/drafter --trace fixed_k_trace.jsonl
"""


EVAL_EPILOG = """\
examples:
  dspark eval-drafter runs/smollm2/drafter --dataset ../shared/data/deepspec_eval/gsm8k.jsonl \\
      --dataset ../shared/data/deepspec_eval/mt-bench.jsonl --num-prompts 80 --calibration-dataset held_out.jsonl \\
      --output-json eval.json --output-plot reliability.png --output-md eval.md --device cuda
"""


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from dspark.train.driver import TrainConfig, check_grow, train_drafter

    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"block_size"}  # --block-size is the KV cache's
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in names}, block_size=args.draft_block_size)
    for field in (
        "num_layers",
        "block_size",
        "steps",
        "blocks_per_sequence",
        "batch_size",
        "prompts_per_source",
        "samples_per_prompt",
        "max_tokens",
        "checkpoint_every",
    ):
        if getattr(cfg, field) < 1:
            raise ConfigError(field, getattr(cfg, field), "must be a positive integer")
    if cfg.time_limit is not None and not cfg.time_limit > 0:
        raise ConfigError("time_limit", cfg.time_limit, "a positive number of seconds")
    if cfg.init_from is not None and not (Path(cfg.init_from) / "config.json").is_file():
        raise ConfigError("init_from", cfg.init_from, "a drafter directory with config.json and *.safetensors")
    check_grow(cfg)  # before the engine loads
    if not Path(cfg.data_dir).is_dir():
        raise ConfigError("data_dir", cfg.data_dir, "must be a directory laid out as ../shared/data")
    llm = load_llm(engine_config(args))
    summary = train_drafter(cfg, llm)
    history = summary.pop("history")
    print(json.dumps(summary))
    for h in history:  # one line per checkpoint: step, running loss, running acceptance estimate
        print(json.dumps(h))
    return 0


def _drafter_run_args(args: argparse.Namespace) -> dict[str, Any]:
    """Checked flags shared by calibrate-drafter and eval-drafter; the engine's keyword arguments."""
    from dspark.train.evaluate import drafter_config

    for field in ("num_prompts", "max_tokens"):
        value = getattr(args, field)
        if value is not None and value < 1:
            raise ConfigError(field, value, "must be a positive integer")
    if args.speculative_config is not None:
        raise ConfigError("speculative_config", args.speculative_config, "not taken: set from DRAFTER_DIR, fixed k")
    drafter_config(args.drafter_dir)
    return dataclasses.asdict(engine_config(args))


def _prompt_files(paths: list[str], field: str, num_prompts: int | None) -> dict[str, list[str]]:
    """name (the file's stem, less .jsonl / .gz) -> its first num_prompts prompts (all when None)."""
    files: dict[str, list[str]] = {}
    for value in paths:
        path = Path(value)
        if not path.is_file():
            raise ConfigError(field, value, "a DeepSpec-format JSON-lines file (.jsonl or .jsonl.gz) that exists")
        name = path.name.removesuffix(".gz").removesuffix(".jsonl")
        if name in files:
            raise ConfigError(field, value, f"names the dataset {name!r} twice")
        files[name] = read_jsonl_prompts(path)[:num_prompts]
    return files


def _temperatures(values: list[float], field: str) -> list[float]:
    if any(t < 0 for t in values) or len(set(values)) < len(values):
        raise ConfigError(field, values, "distinct sampling temperatures, each >= 0")
    return values


def cmd_calibrate_drafter(args: argparse.Namespace) -> int:
    import tempfile

    from dspark.train.calibrate import calibrate_drafter
    from dspark.train.evaluate import fixed_k_llm, run_prompts

    engine_args = _drafter_run_args(args)
    temperatures = _temperatures(args.temperature, "temperature")
    if args.trace is not None and not Path(args.trace).is_file():
        raise ConfigError("trace", args.trace, "a fixed-k trace file that exists")
    if args.trace is not None and len(temperatures) > 1:
        raise ConfigError("temperature", args.temperature, "one value with --trace (a trace records its own)")
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(args.trace) if args.trace else Path(tmp) / "trace.jsonl"
        if args.dataset:
            prompts = [p for ps in _prompt_files(args.dataset, "dataset", args.num_prompts).values() for p in ps]
            llm = fixed_k_llm(engine_args, args.drafter_dir, trace)
            for t in temperatures:
                run_prompts(llm, prompts, t, args.max_tokens, tty(sys.stderr))
        try:
            report = calibrate_drafter(trace, Path(args.drafter_dir), default_temperature=temperatures[0])
        except DSparkError:
            raise
        except ValueError as e:  # no fully verified block in the trace
            raise ConfigError("trace" if args.trace else "dataset", str(args.trace or args.dataset), str(e)) from None
    print(json.dumps(report, indent=2))
    return 0


def cmd_eval_drafter(args: argparse.Namespace) -> int:
    from dspark.train.evaluate import evaluate_drafter, markdown_table, plot_reliability

    engine_args = _drafter_run_args(args)
    _temperatures(args.temperature, "temperature")
    calibration_temperatures = _temperatures(args.calibration_temperature, "calibration_temperature")
    output, md = output_path(args.output_json), output_path(args.output_md, "output_md")
    plot_path = output_path(args.output_plot, "output_plot")
    if plot_path is not None and 1.0 not in args.temperature:
        raise ConfigError("output_plot", str(plot_path), "needs temperature 1 among --temperature (the plot pools it)")
    if args.calibration_trace is not None and not Path(args.calibration_trace).is_file():
        raise ConfigError("calibration_trace", args.calibration_trace, "a fixed-k trace file that exists")
    datasets = _prompt_files(args.dataset, "dataset", args.num_prompts)
    held_out = _prompt_files(args.calibration_dataset or [], "calibration_dataset", args.num_prompts)
    result = evaluate_drafter(
        engine_args,
        args.drafter_dir,
        datasets,
        temperatures=args.temperature,
        max_tokens=args.max_tokens,
        calibration_prompts=[p for ps in held_out.values() for p in ps] if held_out else None,
        calibration_trace=args.calibration_trace,
        calibration_temperatures=calibration_temperatures,
        progress=tty(sys.stderr),
    )
    result["command"] = args.command_line
    table = markdown_table(result)
    write_json(output, result)
    if md is not None:
        md.write_text(f"`{args.command_line}`\n\n{table}\n")
    if plot_path is not None:
        plot_reliability(result, plot_path)
    print(table)
    return 0


def add_parser(subparsers: Any) -> None:
    train = subparsers.add_parser(
        "train-drafter",
        help="train a DSpark drafter for the model on its own answers (resumable)",
        description="Build a prompt pool from --data-dir (never its evaluation sets), have the model answer it,\n"
        "then train a DSpark drafter on those answers with the target frozen and run online. Everything lives in\n"
        "--output-dir: run again with the same directory to resume; the drafter is in <output-dir>/drafter.\n"
        "Answers made beforehand (benchmarks/drafter/gen_data.py) are used instead when --output-dir holds\n"
        "sequences.npz (uint16 token ids) or sequences.jsonl.",
        epilog=TRAIN_EPILOG,
        formatter_class=Formatter,
    )
    g = train.add_argument_group("training")
    g.add_argument("--data-dir", required=True, metavar="DIR", help="prompt sources, laid out as ../shared/data")
    g.add_argument("--output-dir", required=True, metavar="DIR", help="the run directory (created; resumed if there)")
    for flag, default, kind, text in (
        ("--num-layers", 2, int, "draft layers"),
        ("--draft-block-size", 7, int, "K: drafts per block"),
        ("--markov-rank", 32, int, "rank of the Markov head (0: none)"),
        ("--steps", 2000, int, "optimiser steps"),
        ("--batch-size", 8, int, "sequences per optimiser step"),
        ("--lr", 6e-4, float, "peak learning rate"),
        ("--blocks-per-sequence", 16, int, "anchors sampled per sequence and step"),
        ("--prompts-per-source", 500, int, "prompts taken from each source"),
        ("--samples-per-prompt", 1, int, "answers sampled per prompt"),
        ("--max-tokens", 256, int, "most tokens per answer"),
        ("--temperature", 1.0, float, "answer sampling temperature"),
        ("--checkpoint-every", 200, int, "steps between checkpoints"),
        ("--time-limit", None, float, "seconds of training (after the answers): checkpoint, stop; run again to resume"),
    ):
        g.add_argument(flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    g.add_argument(
        "--init-from",
        metavar="DIR",
        help="fine-tune this drafter (e.g. dspark/assets/smollm2-135m-dspark) when --output-dir has no checkpoint yet; "
        "its shape replaces --num-layers, --markov-rank and --draft-block-size, and its calibration is dropped "
        "(run calibrate-drafter after)",
    )
    g.add_argument(
        "--grow-layers",
        type=int,
        default=0,
        metavar="N",
        help="add N layers on top of the --init-from drafter, each starting as the identity, so the deeper drafter "
        "starts out drafting exactly as its source (default: 0)",
    )
    add_engine_args(train)
    train.set_defaults(func=cmd_train_drafter)

    cal = subparsers.add_parser(
        "calibrate-drafter",
        help="fit the drafter's per-position confidence temperatures and shifts (STS) on held-out data",
        description="Sequential Temperature Scaling, with a per-position shift, on a fixed-k trace (given, or\n"
        "recorded here from held-out prompts with k = the drafter's block size); the temperatures and shifts go into\n"
        "DRAFTER_DIR/config.json.",
        epilog=CALIBRATE_EPILOG,
        formatter_class=Formatter,
    )
    cal.add_argument("drafter_dir", metavar="DRAFTER_DIR", help="the drafter directory (config.json + safetensors)")
    g = cal.add_argument_group("calibration")
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="a fixed-k trace recorded with this drafter")
    source.add_argument("--dataset", action="append", metavar="FILE", help="held-out prompts, JSON lines (repeatable)")
    g.add_argument("--num-prompts", metavar="N", type=int, help="prompts taken from each file (default: all)")
    g.add_argument("--max-tokens", metavar="N", type=int, default=256, help="tokens per answer (default: %(default)s)")
    g.add_argument(
        "--temperature",
        metavar="T",
        type=float,
        nargs="+",
        default=[1.0],
        help="the held-out prompts' sampling temperatures, one fit each: greedy requests (0) and sampled ones "
        "survive differently (default: 1.0). A fit replaces the stored one at its temperature and keeps the others",
    )
    add_engine_args(cal)
    cal.set_defaults(func=cmd_calibrate_drafter)

    ev = subparsers.add_parser(
        "eval-drafter",
        help="acceptance length, per-position acceptance and survival calibration of a drafter, per dataset",
        description="Run every --dataset at every --temperature with k = the drafter's block size (adaptive\n"
        "verification off) and print, per row, tau = 1 + accepted/drafts, the conditional acceptance per position,\n"
        "and the survival ECE (20 bins) before and after STS, AUROC and Brier. The STS scaling is fitted on\n"
        "--calibration-dataset or --calibration-trace (held-out), else the drafter's stored one is scored.",
        epilog=EVAL_EPILOG,
        formatter_class=Formatter,
    )
    ev.add_argument("drafter_dir", metavar="DRAFTER_DIR", help="the drafter directory (config.json + safetensors)")
    g = ev.add_argument_group("evaluation")
    g.add_argument(
        "--dataset",
        action="append",
        required=True,
        metavar="FILE",
        help="DeepSpec-format prompts, .jsonl or .jsonl.gz; named by the file's stem (repeatable)",
    )
    g.add_argument("--num-prompts", metavar="N", type=int, help="prompts taken from each file (default: all)")
    g.add_argument("--max-tokens", metavar="N", type=int, default=256, help="tokens per answer (default: %(default)s)")
    g.add_argument("--temperature", metavar="T", type=float, nargs="+", default=[1.0, 0.0], help="(default: 1.0 0.0)")
    held_out = g.add_mutually_exclusive_group()
    held_out.add_argument(
        "--calibration-dataset", action="append", metavar="FILE", help="held-out prompts to fit STS on (repeatable)"
    )
    held_out.add_argument("--calibration-trace", metavar="FILE", help="a held-out fixed-k trace to fit STS on")
    g.add_argument(
        "--calibration-temperature",
        metavar="T",
        type=float,
        nargs="+",
        default=[1.0],
        help="sampling temperatures of the --calibration-dataset runs, one fit each (default: 1.0)",
    )
    g.add_argument("--output-json", metavar="PATH", help="write the results here")
    g.add_argument("--output-plot", metavar="PATH", help="write the reliability diagram here (PNG)")
    g.add_argument("--output-md", metavar="PATH", help="write the markdown table here")
    add_engine_args(ev)
    ev.set_defaults(func=cmd_eval_drafter)
