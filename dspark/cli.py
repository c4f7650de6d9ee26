"""`dspark` on the command line: generate, chat, bench throughput.

Engine flags follow vLLM's names, so a command line moves between the two with few edits. A user error (a bad flag
value, a missing model or file) ends as one line, `error: <message>`, on stderr with exit status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any, TextIO

from dspark import __version__
from dspark.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    MAX_LOGPROBS,
    EngineConfig,
    SamplingParams,
    SpeculativeConfig,
)
from dspark.errors import ConfigError, DSparkError
from dspark.llm import LLM
from dspark.models.registry import DEFAULT_MODEL
from dspark.outputs import RequestOutput

EXIT_USAGE = 2

# Sampling flags whose values go to SamplingParams unchanged when given (None: keep SamplingParams' default).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "min_tokens",
    "stop",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
)


class _StderrHandler(logging.Handler):
    """Writes to whatever sys.stderr is at the time (a StreamHandler keeps the stream it was made with, which a test
    harness may have closed since)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the line breaks of descriptions and epilogs (the examples), wraps flag help as usual."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36)


# ---- shared flags -------------------------------------------------------------------------------------------------


def add_engine_args(parser: argparse.ArgumentParser, *, max_num_seqs: bool = True) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        metavar="M",
        default=DEFAULT_MODEL,
        help="model alias, Hugging Face directory or .gguf file (default: %(default)s)",
    )
    g.add_argument("--tokenizer", metavar="T", help="tokenizer directory or .gguf file (default: the model's)")
    g.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weight and activation dtype; auto: bfloat16 on CUDA and on CPUs with native bf16, else float32 "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where to run; auto: CUDA when available (default: %(default)s)",
    )
    g.add_argument(
        "--max-model-len", metavar="N", type=int, help="context length, prompt plus output (default: the model's)"
    )
    if max_num_seqs:
        g.add_argument(
            "--max-num-seqs", metavar="N", type=int, default=256, help="most sequences in flight (default: %(default)s)"
        )
    g.add_argument(
        "--max-num-batched-tokens",
        metavar="N",
        type=int,
        default=2048,
        help="most tokens in one step (default: %(default)s)",
    )
    g.add_argument(
        "--block-size", metavar="N", type=int, default=16, help="tokens per KV-cache block (default: %(default)s)"
    )
    g.add_argument(
        "--kv-cache-memory-gb",
        metavar="GB",
        type=float,
        default=2.0,
        help="KV-cache size on CPU in GiB (default: %(default)s)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        metavar="F",
        type=float,
        default=0.9,
        help="fraction of GPU memory the engine may use, KV cache included (default: %(default)s)",
    )
    g.add_argument("--num-kv-blocks", metavar="N", type=int, help="KV-cache blocks, overriding the two sizes above")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of shared prompt prefixes (default: on)",
    )
    g.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prepare and launch the next decode step while the device runs this one (default: on for CUDA)",
    )
    g.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="auto: Triton on CUDA, the torch reference on CPU (default: %(default)s)",
    )
    g.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a token's logits never depend on its batch: greedy output with speculation equals output without it "
        "bit for bit (bf16 too); CUDA steps get slower (fixed-tile GEMMs, no key splits)",
    )
    g.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "dspark", "model": DIR, "num_speculative_tokens": 7, "draft_sample_method": '
        '"probabilistic"|"greedy"}\' (default: none)',
    )
    g.add_argument(
        "--seed",
        metavar="N",
        type=int,
        default=0,
        help="seed of the engine's random streams; the same seed gives the same samples (default: %(default)s)",
    )


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """An EngineConfig from the parsed flags: validated here, before any model is loaded."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and k != "speculative_config"}
    raw = getattr(args, "speculative_config", None)
    if raw is not None:
        try:
            values["speculative_config"] = json.loads(raw)
        except ValueError as e:  # not JSON, or an int of more digits than Python converts
            raise ConfigError("speculative_config", raw, f"a JSON object ({e})") from None
        except RecursionError:
            raise ConfigError("speculative_config", raw, "a JSON object, nested less deeply") from None
    return EngineConfig(**{**values, **overrides})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling (defaults as vLLM's SamplingParams)")
    g.add_argument("--temperature", metavar="T", type=float, help="0 is greedy (default: 1.0)")
    g.add_argument("--top-p", metavar="P", type=float, help="nucleus mass in (0, 1] (default: 1.0)")
    g.add_argument("--top-k", metavar="K", type=int, help="keep the k most likely tokens; -1 or 0: all (default: -1)")
    g.add_argument(
        "--min-p", metavar="P", type=float, help="drop tokens below min_p times the top probability (default: 0)"
    )
    g.add_argument(
        "--max-tokens", metavar="N", type=int, default=256, help="most tokens to generate (default: %(default)s)"
    )
    g.add_argument(
        "--min-tokens", metavar="N", type=int, help="tokens to generate before EOS or a stop may end (default: 0)"
    )
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop at this string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="keep generating after EOS")
    g.add_argument("--presence-penalty", metavar="X", type=float, help="in [-2, 2] (default: 0)")
    g.add_argument("--frequency-penalty", metavar="X", type=float, help="in [-2, 2] (default: 0)")
    g.add_argument("--repetition-penalty", metavar="X", type=float, help="> 0; 1 is none (default: 1.0)")
    g.add_argument(
        "--logprobs", type=int, metavar="N", help=f"return the top-N logprobs of each token (0-{MAX_LOGPROBS})"
    )


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**{k: getattr(args, k) for k in SAMPLING_FIELDS if getattr(args, k) is not None})


def _load_llm(config: EngineConfig) -> LLM:
    return LLM(**dataclasses.asdict(config))


# ---- generate -----------------------------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = _load_llm(engine_config(args))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=_tty(sys.stderr))
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=_tty(sys.stderr))
    if args.json:
        print(json.dumps([_completion_json(p, o) for p, o in zip(args.prompt, outputs, strict=True)], indent=2))
        return 0
    for i, (prompt, out) in enumerate(zip(args.prompt, outputs, strict=True)):
        completion = out.outputs[0]
        if len(args.prompt) > 1:
            if i:
                print()
            print(f"### {i + 1}: {_shorten(prompt)}")
        print(completion.text)
        if completion.cumulative_logprob is not None:
            print(f"(cumulative logprob {completion.cumulative_logprob:.4f} over {len(completion.token_ids)} tokens)")
    return 0


def _completion_json(prompt: str, out: RequestOutput) -> dict[str, Any]:
    c = out.outputs[0]
    record: dict[str, Any] = {
        "prompt": prompt,
        "text": c.text,
        "token_ids": c.token_ids,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }
    if c.logprobs is not None:
        record["cumulative_logprob"] = c.cumulative_logprob
        record["logprobs"] = [
            [
                {"token_id": t, "logprob": lp.logprob, "rank": lp.rank, "token": lp.decoded_token}
                for t, lp in pos.items()
            ]
            for pos in c.logprobs
        ]
    return record


def _shorten(text: str, width: int = 70) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def _tty(stream: Any) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


# ---- chat ---------------------------------------------------------------------------------------------------------


class ChatSession:
    """A conversation over one engine: each answer streams to `out` token by token as the engine produces it."""

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.params = params
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict[str, str]] = []

    def prompt_ids(self) -> list[int]:
        """The templated conversation; the oldest exchanges are dropped while it overflows the context."""
        while True:
            ids = self.llm.apply_chat_template(self.system + self.turns)
            if len(ids) < self.engine.max_model_len or len(self.turns) <= 1:
                return ids
            self.turns = self.turns[2:]

    def answer(self, message: str, out: TextIO) -> str:
        self.turns.append({"role": "user", "content": message})
        try:
            request_id = self.engine.add_request(self.prompt_ids(), self.params)
        except DSparkError:
            self.turns.pop()
            raise
        text = ""
        try:
            while self.engine.has_unfinished_requests():
                for step_out in self.engine.step():
                    out.write(step_out.new_text)
                    out.flush()
                    if step_out.finished:
                        text = step_out.outputs[0].text
        except KeyboardInterrupt:
            # Ctrl-C stops this answer, not the session: forget the unanswered message.
            self.engine.abort_request(request_id)
            self.turns.pop()
            out.write("\n")
            return ""
        out.write("\n")
        out.flush()
        self.turns.append({"role": "assistant", "content": text})
        return text


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    session = ChatSession(_load_llm(engine_config(args)), params, args.system)
    if args.once is not None:
        session.answer(args.once, sys.stdout)
        return 0
    interactive = _tty(sys.stdin)
    if interactive:
        print(f"dspark chat with {args.model}: /exit or Ctrl-D quits, Ctrl-C stops an answer", file=sys.stderr)
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            break
        if not line:  # EOF on a pipe
            break
        message = line.strip()
        if message in ("/exit", "/quit"):
            break
        if not message:
            continue
        try:
            session.answer(message, sys.stdout)
        except ConfigError as e:  # e.g. one message longer than the context: say so and keep the session
            print(f"error: {e}", file=sys.stderr)
    if interactive:
        print(file=sys.stderr)
    return 0


# ---- bench throughput ---------------------------------------------------------------------------------------------


def output_path(value: str | None, field: str = "output_json") -> Path | None:
    """An output file flag (--output-json, --output-plot, ...), checked before a long run rather than after it."""
    output = Path(value) if value else None
    if output is not None and not output.parent.is_dir():
        raise ConfigError(field, str(output), f"its directory {output.parent} does not exist")
    return output


def write_json(output: Path | None, result: dict[str, Any]) -> None:
    if output is not None:
        try:
            output.write_text(json.dumps(result, indent=2) + "\n")
        except OSError as e:
            raise ConfigError("output_json", str(output), f"cannot be written ({e})") from None


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from dspark.bench.throughput import run_throughput, summary_line

    if args.batch_size < 1:
        raise ConfigError("batch_size", args.batch_size, "must be a positive integer")
    config = engine_config(args, max_num_seqs=args.batch_size)
    output = output_path(args.output_json)
    result = run_throughput(
        config,
        num_prompts=args.num_prompts,
        output_len=args.output_len,
        dataset_path=args.dataset_path,
        chat=args.chat,
        hf=args.hf,
        repeats=args.repeats,
        command=args.command_line,
    )
    write_json(output, result)
    print(summary_line(result))
    return 0


def cmd_bench_spec(args: argparse.Namespace) -> int:
    from dspark.bench.spec import run_spec_bench, summary_table

    batch_sizes = args.batch_size or [1, 8]
    config = engine_config(args, max_num_seqs=max(b for b in batch_sizes if isinstance(b, int)))
    output = output_path(args.output_json)
    result = run_spec_bench(
        config,
        batch_sizes=batch_sizes,
        num_prompts=args.num_prompts,
        output_len=args.output_len,
        dataset_path=args.dataset_path,
        chat=args.chat,
        temperature=args.temperature,
        repeats=args.repeats,
        command=args.command_line,
    )
    write_json(output, result)
    print(summary_table(result))
    return 0


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


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from dspark.train.driver import TrainConfig, train_drafter

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
    if not Path(cfg.data_dir).is_dir():
        raise ConfigError("data_dir", cfg.data_dir, "must be a directory laid out as ../shared/data")
    llm = _load_llm(engine_config(args))
    summary = train_drafter(cfg, llm)
    history = summary.pop("history")
    print(json.dumps(summary))
    for h in history:  # one line per checkpoint: step, running loss, running acceptance estimate
        print(json.dumps(h))
    return 0


# ---- drafter calibration and evaluation ---------------------------------------------------------------------------


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
    from dspark.bench.throughput import read_jsonl_prompts

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


def cmd_calibrate_drafter(args: argparse.Namespace) -> int:
    import tempfile

    from dspark.train.calibrate import calibrate_drafter
    from dspark.train.evaluate import fixed_k_llm, run_prompts

    engine_args = _drafter_run_args(args)
    if args.temperature < 0:
        raise ConfigError("temperature", args.temperature, "must be >= 0")
    if args.trace is not None and not Path(args.trace).is_file():
        raise ConfigError("trace", args.trace, "a fixed-k trace file that exists")
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(args.trace) if args.trace else Path(tmp) / "trace.jsonl"
        if args.dataset:
            prompts = [p for ps in _prompt_files(args.dataset, "dataset", args.num_prompts).values() for p in ps]
            llm = fixed_k_llm(engine_args, args.drafter_dir, trace)
            run_prompts(llm, prompts, args.temperature, args.max_tokens, _tty(sys.stderr))
        try:
            report = calibrate_drafter(trace, Path(args.drafter_dir))
        except DSparkError:
            raise
        except ValueError as e:  # no fully verified block in the trace
            raise ConfigError("trace" if args.trace else "dataset", str(args.trace or args.dataset), str(e)) from None
    print(json.dumps(report, indent=2))
    return 0


def cmd_eval_drafter(args: argparse.Namespace) -> int:
    from dspark.train.evaluate import evaluate_drafter, markdown_table, plot_reliability

    engine_args = _drafter_run_args(args)
    if any(t < 0 for t in args.temperature):
        raise ConfigError("temperature", args.temperature, "every temperature must be >= 0")
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
        progress=_tty(sys.stderr),
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


CALIBRATE_EPILOG = """\
examples:
  dspark calibrate-drafter runs/smollm2/drafter --dataset held_out.jsonl --num-prompts 200 --device cuda
  dspark calibrate-drafter runs/smollm2/drafter --trace fixed_k_trace.jsonl
"""
EVAL_EPILOG = """\
examples:
  dspark eval-drafter runs/smollm2/drafter --dataset ../shared/data/deepspec_eval/gsm8k.jsonl \\
      --dataset ../shared/data/deepspec_eval/mt-bench.jsonl --num-prompts 80 --calibration-dataset held_out.jsonl \\
      --output-json eval.json --output-plot reliability.png --output-md eval.md --device cuda
"""


def _add_drafter_parsers(commands: Any) -> None:
    cal = commands.add_parser(
        "calibrate-drafter",
        help="fit the drafter's per-position confidence temperatures and shifts (STS) on held-out data",
        description="Sequential Temperature Scaling, with a per-position shift, on a fixed-k trace (given, or\n"
        "recorded here from held-out prompts with k = the drafter's block size); the temperatures and shifts go into\n"
        "DRAFTER_DIR/config.json.",
        epilog=CALIBRATE_EPILOG,
        formatter_class=_Formatter,
    )
    cal.add_argument("drafter_dir", metavar="DRAFTER_DIR", help="the drafter directory (config.json + safetensors)")
    g = cal.add_argument_group("calibration")
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="a fixed-k trace recorded with this drafter")
    source.add_argument("--dataset", action="append", metavar="FILE", help="held-out prompts, JSON lines (repeatable)")
    g.add_argument("--num-prompts", metavar="N", type=int, help="prompts taken from each file (default: all)")
    g.add_argument("--max-tokens", metavar="N", type=int, default=256, help="tokens per answer (default: %(default)s)")
    g.add_argument("--temperature", metavar="T", type=float, default=1.0, help="sampling (default: %(default)s)")
    add_engine_args(cal)
    cal.set_defaults(func=cmd_calibrate_drafter)

    ev = commands.add_parser(
        "eval-drafter",
        help="acceptance length, per-position acceptance and survival calibration of a drafter, per dataset",
        description="Run every --dataset at every --temperature with k = the drafter's block size (adaptive\n"
        "verification off) and print, per row, tau = 1 + accepted/drafts, the conditional acceptance per position,\n"
        "and the survival ECE (20 bins) before and after STS, AUROC and Brier. The STS scaling is fitted on\n"
        "--calibration-dataset or --calibration-trace (held-out), else the drafter's stored one is scored.",
        epilog=EVAL_EPILOG,
        formatter_class=_Formatter,
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
    g.add_argument("--output-json", metavar="PATH", help="write the results here")
    g.add_argument("--output-plot", metavar="PATH", help="write the reliability diagram here (PNG)")
    g.add_argument("--output-md", metavar="PATH", help="write the markdown table here")
    add_engine_args(ev)
    ev.set_defaults(func=cmd_eval_drafter)


# ---- parser -------------------------------------------------------------------------------------------------------

GENERATE_EPILOG = """\
examples:
  dspark generate --prompt "The capital of France is" --temperature 0 --max-tokens 16
  dspark generate --chat --prompt "Write a haiku about tea." --prompt "What is 17 * 23?" --json
"""
CHAT_EPILOG = """\
examples:
  dspark chat --system "You are a terse assistant." --temperature 0.2
  dspark chat --once "Explain recursion in two sentences." --temperature 0
"""
BENCH_EPILOG = """\
examples:
  dspark bench throughput --num-prompts 16 --output-len 64 --batch-size 16 --output-json out/tp.json
  dspark bench spec --speculative-config '{"method": "ngram"}' --batch-size 1 --batch-size 8
"""
SPEC_EPILOG = """\
examples:
  dspark bench spec --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' --batch-size 1
  dspark bench spec --dataset-path gsm8k.jsonl --num-prompts 32 --batch-size 1 --batch-size 8 --repeats 3 \\
      --speculative-config '{"method": "dspark", "model": "drafter/", "num_speculative_tokens": 7}'
"""
PROFILE_EPILOG = """\
examples:
  dspark profile --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' --output-plot cost.png
  dspark profile --speculative-config '{"method": "dspark", "model": "drafter/"}' --output-json cost.json --force
"""
TRAIN_EPILOG = """\
examples:
  dspark train-drafter --data-dir ../shared/data --output-dir runs/smollm2 --steps 4000 --device cuda
  dspark train-drafter --data-dir ../shared/data --output-dir runs/smollm2 --steps 8000   # resume, train longer
"""
THROUGHPUT_EPILOG = """\
Both arms get the same prompt token ids, decode greedily and produce exactly --output-len tokens per prompt; the
transformers model is built from the same loaded weights. The summary line reads:
  dspark <tok/s> | hf <tok/s> | ratio <dspark/hf>x (<prompts> x <tokens>, batch <B>, <dtype>, <device>)

examples:
  dspark bench throughput --num-prompts 16 --output-len 64 --batch-size 16
  dspark bench throughput --dtype bfloat16 --batch-size 1 --output-json out/tp-bf16-b1.json
  dspark bench throughput --dataset-path prompts.jsonl --num-prompts 100 --no-hf
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dspark",
        description="dspark: an LLM inference engine with DSpark speculative decoding.",
        epilog="run `dspark <command> --help` for a command's flags; "
        "the default model is downloaded to $DSPARK_CACHE (~/.cache/dspark) on first use",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"dspark {__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", required=True, metavar="<command>")

    gen = commands.add_parser(
        "generate",
        help="complete one or more prompts and print the results",
        description="Complete each --prompt (all in one batch) and print the completions in order.",
        epilog=GENERATE_EPILOG,
        formatter_class=_Formatter,
    )
    gen.add_argument("--prompt", action="append", required=True, metavar="TEXT", help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    gen.add_argument("--json", action="store_true", help="print a JSON list: text, token_ids, finish_reason, ...")
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = commands.add_parser(
        "chat",
        help="talk to the model in the terminal, answers streamed as they are generated",
        description="An interactive chat: type a message, read the streamed answer; the conversation is kept.\n"
        "/exit or end of input (Ctrl-D) quits; Ctrl-C stops the answer being written.",
        epilog=CHAT_EPILOG,
        formatter_class=_Formatter,
    )
    chat.add_argument("--system", metavar="TEXT", help="a system message that opens the conversation")
    chat.add_argument("--once", metavar="TEXT", help="answer this one message and exit")
    add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    from dspark.server.cli import add_parser as add_serve

    add_serve(commands, _Formatter)

    bench = commands.add_parser(
        "bench",
        help="benchmarks",
        description="Benchmarks that print a one-line summary and can write their results as JSON.",
        epilog=BENCH_EPILOG,
        formatter_class=_Formatter,
    )
    benches = bench.add_subparsers(title="benchmarks", dest="bench", required=True, metavar="<benchmark>")
    tp = benches.add_parser(
        "throughput",
        help="offline output tokens/s of dspark against Hugging Face transformers, in the same run",
        description="Offline throughput: a fixed prompt set in a fixed order through dspark and through\n"
        "transformers `generate` (static left-padded batches), greedy, same weights, same dtype.",
        epilog=THROUGHPUT_EPILOG,
        formatter_class=_Formatter,
    )
    g = tp.add_argument_group("benchmark")
    g.add_argument(
        "--num-prompts",
        metavar="N",
        type=int,
        default=32,
        help="prompts to run; the set repeats if shorter (default: %(default)s)",
    )
    g.add_argument(
        "--output-len",
        metavar="L",
        type=int,
        default=128,
        help="tokens generated per prompt, EOS ignored (default: %(default)s)",
    )
    g.add_argument(
        "--batch-size",
        metavar="B",
        type=int,
        default=16,
        help="most sequences in flight: dspark's max_num_seqs, transformers' static batch (default: %(default)s)",
    )
    g.add_argument(
        "--dataset-path",
        metavar="FILE.jsonl",
        help="JSON lines with 'prompt', 'turns' or 'question' (default: the built-in set of 32 prompts)",
    )
    g.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template (default: on)"
    )
    g.add_argument(
        "--hf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the transformers baseline (default: on)",
    )
    g.add_argument(
        "--repeats",
        metavar="R",
        type=int,
        default=1,
        help="rounds, the arms alternating within each; medians are reported (default: %(default)s)",
    )
    g.add_argument("--output-json", metavar="PATH", help="write the results here")
    add_engine_args(tp, max_num_seqs=False)
    tp.set_defaults(func=cmd_bench_throughput)

    sp = benches.add_parser(
        "spec",
        help="speculative decoding against none: speed-up and acceptance length, in the same run",
        description="A speculative config against no speculation on the same prompts, at each batch size.\n"
        "Requests stop at EOS or --output-len; at temperature 0 the outputs are checked to be identical.",
        epilog=SPEC_EPILOG,
        formatter_class=_Formatter,
    )
    g = sp.add_argument_group("benchmark")
    g.add_argument("--num-prompts", metavar="N", type=int, default=16, help="prompts to run (default: %(default)s)")
    g.add_argument(
        "--output-len", metavar="L", type=int, default=128, help="most tokens per prompt (default: %(default)s)"
    )
    g.add_argument(
        "--batch-size",
        metavar="B",
        type=int,
        action="append",
        help="max_num_seqs of one row (repeatable; default: 1 and 8)",
    )
    g.add_argument("--temperature", metavar="T", type=float, default=0.0, help="(default: %(default)s, greedy)")
    g.add_argument(
        "--dataset-path",
        metavar="FILE.jsonl",
        help="JSON lines with 'prompt', 'turns' or 'question' (default: the built-in set of 32 prompts)",
    )
    g.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template (default: on)"
    )
    g.add_argument("--repeats", metavar="R", type=int, default=1, help="rounds, arms alternating (default: 1)")
    g.add_argument("--output-json", metavar="PATH", help="write the results here")
    add_engine_args(sp, max_num_seqs=False)
    sp.set_defaults(func=cmd_bench_spec)

    from dspark.bench.sweep import add_parser as add_sweep

    add_sweep(benches, _Formatter)

    from dspark.bench.serve import add_parser as add_serve_bench

    add_serve_bench(benches, _Formatter)

    from dspark.bench.load_cli import add_parser as add_load_bench

    add_load_bench(benches, _Formatter)

    prof = commands.add_parser(
        "profile",
        help="profile (or show the cached) step-cost curves adaptive verification plans with",
        description="Build the engine with a speculative config (adaptive verification on), which profiles the target\n"
        "step by token count and the draft step by request count (or loads them from $DSPARK_CACHE/cost_models),\n"
        "then print the points and optionally write them as JSON and a plot.",
        epilog=PROFILE_EPILOG,
        formatter_class=_Formatter,
    )
    g = prof.add_argument_group("profile")
    g.add_argument("--force", action="store_true", help="profile again even when a cached profile matches")
    g.add_argument("--output-json", metavar="PATH", help="write the cost model here (a file `dspark simulate` reads)")
    g.add_argument("--output-plot", metavar="PATH", help="write the curves here (PNG)")
    add_engine_args(prof)
    prof.set_defaults(func=cmd_profile)

    train = commands.add_parser(
        "train-drafter",
        help="train a DSpark drafter for the model on its own answers (resumable)",
        description="Build a prompt pool from --data-dir (never its evaluation sets), have the model answer it,\n"
        "then train a DSpark drafter on those answers with the target frozen and run online. Everything lives in\n"
        "--output-dir: run again with the same directory to resume; the drafter is in <output-dir>/drafter.",
        epilog=TRAIN_EPILOG,
        formatter_class=_Formatter,
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
    add_engine_args(train)
    train.set_defaults(func=cmd_train_drafter)

    _add_drafter_parsers(commands)

    from dspark.bench.simulate import add_parser as add_simulate

    add_simulate(commands, _Formatter)

    from dspark.evals.cli import add_parser as add_eval

    add_eval(commands, _Formatter)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help / --version (0), or a usage error argparse has already printed (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    args.command_line = shlex.join(["dspark", *argv])
    log = logging.getLogger("dspark")  # one-off notices, e.g. start-up profiling, on stderr
    if not log.handlers:
        log.addHandler(_StderrHandler())
        log.setLevel(logging.INFO)
    try:
        return args.func(args)
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
