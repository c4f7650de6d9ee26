"""Where a speculative DSpark step's time goes on CPU: median milliseconds per part, at batch 1.

    .venv/bin/python benchmarks/cpu_step_parts.py --num-prompts 4 --max-tokens 128 [--fixed-k] [--threads N] \
        [--dataset F.jsonl] [--output-json F.json]

The engine is the default one (SmolLM2-135M-Instruct with its shipped DSpark drafter, dtype "auto": bf16 on CPUs with
native bf16, else fp32) on the fast CPU path (not batch-invariant, so the drafter defers its context write). Each
prompt's first turn goes through the chat template, one request at a time, greedy, ignoring EOS.

Timed by wrapping methods of the engine's classes with wall-clock timers (the CPU runs every op synchronously, so a
call's wall time is its cost), each call filed under the parts it ran inside:

- the whole step (EngineCore.step), over all steps and by kind (engine/core.py step_kind: prefill, plain, draft,
  verify, verify+draft; a speculative step is verify+draft);
- target forward (ModelRunner._forward_eager; the target's logits are computed inside verify or sampling);
- verify (ModelRunner._verify: target logits, acceptance);
- propose (DSparkDrafter.propose), and within it the deferred context flush and the drafter's block pass: backbone
  (DSparkModel.backbone), draft logits (CausalLM.draft_logits) and the Markov loop (markov.sample_block_with);
- deferred context flush (DSparkDrafter.flush_context), wherever it runs: in propose, when DEFER_ROWS are held, when a
  request is released; only calls that had rows to write are counted;
- context write of 1 and DEFER_ROWS (64) rows (DSparkDrafter._write_context on random taps, after the run): what
  extend_context would cost a plain step without deferral, and what a flush of DEFER_ROWS rows costs.

A part's median is over its calls; a parent's median is not the sum of its children's (they need not run in every
call). Each timer costs a few microseconds of Python per call, noise beside these parts. With adaptive verification
(the default) short MT-bench runs may draft in no step at all; with --fixed-k every step drafts but a request's
prefill and its last, so the drafting parts are timed.

On a machine shared with other work, medians survive a few preempted calls but not a busy neighbour: run it when the
machine is idle, or with fewer threads than cores (--threads 1 on 2 vCPUs). With every core a thread, one preempted
thread stalls each op at its barrier: steps ran ~30x slower here that way while another process used one of the two
vCPUs. The min column then shows what a call costs when nothing preempts it.

The script is not part of the package: nothing imports it.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dspark import LLM, SamplingParams
from dspark.bench.prompts import BUILTIN_PROMPTS
from dspark.engine import core as engine_core
from dspark.models import llama
from dspark.speculative.drafters.dspark import drafter as drafter_module
from dspark.speculative.drafters.dspark import model as model_module
from dspark.utils.jsonl import read_jsonl_prompts
from dspark.worker import model_runner

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATASET = REPO.parent / "shared/data/deepspec_eval/mt-bench.jsonl"  # the checkouts' shared data
CONTEXT_ROWS = (1, drafter_module.DSparkDrafter.DEFER_ROWS)  # a plain step's context write; a full deferred flush


class PartTimer:
    """Wall-clock timers around methods, each call filed under the path of timed calls it ran inside ("step/propose/
    block/backbone"), so that a flush inside propose and one at a request's release are told apart."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}  # path -> seconds per call, in the order paths were first entered
        self.step_kinds: dict[str, list[float]] = {}  # a step's kind -> seconds per step
        self._stack: list[str] = []
        self._restore: list[tuple[Any, str, Any]] = []

    @contextmanager
    def part(self, label: str) -> Iterator[str]:
        path = "/".join([*self._stack, label])
        self.samples.setdefault(path, [])  # entry order: see ordered()
        self._stack.append(label)
        start = time.perf_counter()
        try:
            yield path
        finally:
            self._stack.pop()
            self.samples[path].append(time.perf_counter() - start)

    def wrap(self, owner: Any, name: str, label: str, skip: Callable[..., bool] | None = None) -> None:
        """Time owner.name (a class's method or a module's function) under `label`; calls for which skip(*args)
        holds run untimed (flush_context with nothing held returns at once: counted, it would pull the median to 0)."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if skip is not None and skip(*args):
                return original(*args, **kwargs)
            with self.part(label):
                return original(*args, **kwargs)

        self._restore.append((owner, name, original))
        setattr(owner, name, timed)

    def wrap_step(self, core: engine_core.EngineCore) -> None:
        """EngineCore.step, filed under "step" and again under its kind, known only once it returned."""
        original = core.step

        def timed() -> Any:
            with self.part("step") as path:
                out = original()
            self.step_kinds.setdefault(core.last_step_kind, []).append(self.samples[path][-1])
            return out

        self._restore.append((core, "step", None))  # an instance attribute: deleted, the class's method is back
        core.step = timed  # type: ignore[method-assign]

    def restore(self) -> None:
        for owner, name, original in reversed(self._restore):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._restore.clear()

    def ordered(self) -> list[tuple[str, list[float]]]:
        """The paths depth first, each under its parent, siblings in the order they were first entered (a part first
        seen late, such as a flush at a request's release, would otherwise land under an unrelated one)."""
        rank = {path: i for i, path in enumerate(self.samples)}

        def key(path: str) -> tuple[int, ...]:
            labels = path.split("/")
            return tuple(rank.get("/".join(labels[: i + 1]), -1) for i in range(len(labels)))

        return sorted(self.samples.items(), key=lambda item: key(item[0]))


def summary(seconds: list[float]) -> dict[str, float]:
    """Per-call milliseconds. The minimum beside the median: on a shared machine it shows what a call costs when
    nothing preempts it."""
    ms = [s * 1e3 for s in seconds]
    return {
        "calls": len(ms),
        "median_ms": statistics.median(ms),
        "min_ms": min(ms),
        "mean_ms": statistics.fmean(ms),
        "total_ms": sum(ms),
    }


def context_write(drafter: drafter_module.DSparkDrafter, rows: int, repeats: int) -> dict[str, float]:
    """The drafter's context write of `rows` random rows at slots 0..rows-1 (the run is over: what they overwrite is
    not read again), as extend_context does it when nothing is deferred: fc, hidden_norm, every layer's keys and
    values, the cache write."""
    width = drafter.model.config.hidden_size * len(drafter.tap_layers)
    taps = torch.randn(rows, width, dtype=drafter.model.fc.weight.dtype)
    positions = torch.arange(rows)
    slots = torch.arange(rows)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 5):  # 5 untimed: oneDNN sets up its kernels for a new shape on the first calls
            start = time.perf_counter()
            drafter._write_context(taps, positions, slots)
            if i >= 5:
                times.append(time.perf_counter() - start)
    return summary(times)


def load_prompts(dataset: str | None, num_prompts: int) -> list[str]:
    """The first num_prompts prompts of the set (repeated if it is shorter); the built-in ones without a set."""
    prompts = BUILTIN_PROMPTS if dataset is None else read_jsonl_prompts(Path(dataset))
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dataset",
        default=str(DEFAULT_DATASET) if DEFAULT_DATASET.exists() else None,
        help="JSON-lines prompts ('prompt', 'turns' or 'question' per line); default: DeepSpec's MT-bench in "
        "../shared/data where it exists, else the built-in prompts",
    )
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (EOS ignored)")
    parser.add_argument(
        "--fixed-k",
        action="store_true",
        help="verify every draft (the drafter's block size) each step: no adaptive verification, so every step drafts "
        "but a request's prefill and its last",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch's intra-op threads (default: torch's choice, one per core). On a machine shared with other work, "
        "fewer threads than cores keeps a preempted thread from stalling every op at its barrier",
    )
    parser.add_argument("--context-repeats", type=int, default=50, help="timed context writes per row count")
    parser.add_argument("--output-json", help="also write the figures here")
    args = parser.parse_args()

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    prompts = load_prompts(args.dataset, args.num_prompts)
    spec: dict[str, Any] = {"method": "dspark"}
    if args.fixed_k:
        spec["enable_adaptive_verification"] = False
    # Explicitly the fast CPU path: $DSPARK_BATCH_INVARIANT would otherwise switch to the padded reference path.
    llm = LLM(device="cpu", batch_invariant=False, speculative_config=spec)
    core = llm.engine.core
    drafter = core.runner.drafter
    assert isinstance(drafter, drafter_module.DSparkDrafter) and drafter.defer_context, "not the fast CPU path"

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # Warm-up (untimed): oneDNN's first calls per shape, the drafter's lazily packed lm_head (draft_logits).
    llm.chat([{"role": "user", "content": prompts[0]}], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))

    timer = PartTimer()
    timer.wrap_step(core)
    timer.wrap(model_runner.ModelRunner, "_forward_eager", "target forward")
    timer.wrap(model_runner.ModelRunner, "_verify", "verify")
    timer.wrap(drafter_module.DSparkDrafter, "propose", "propose")
    timer.wrap(drafter_module.DSparkDrafter, "flush_context", "context flush", skip=lambda d: not d._pending)
    timer.wrap(drafter_module.DSparkDrafter, "block", "block")
    timer.wrap(model_module.DSparkModel, "backbone", "backbone")
    timer.wrap(llama.CausalLM, "draft_logits", "draft logits")
    # The drafter module's own name for it (imported by name there), which is what block calls.
    timer.wrap(drafter_module, "sample_block_with", "markov loop")
    metrics_before = llm.get_metrics()
    num_tokens = 0
    start = time.perf_counter()
    try:
        for prompt in prompts:
            out = llm.chat([{"role": "user", "content": prompt}], params)
            num_tokens += len(out[0].outputs[0].token_ids)
    finally:
        timer.restore()
    wall = time.perf_counter() - start
    metrics = llm.get_metrics()
    drafts = metrics["spec_decode_num_drafts"] - metrics_before["spec_decode_num_drafts"]
    accepted = metrics["spec_decode_num_accepted_tokens"] - metrics_before["spec_decode_num_accepted_tokens"]

    parts = {path: summary(seconds) for path, seconds in timer.ordered() if seconds}
    steps = {kind: summary(seconds) for kind, seconds in timer.step_kinds.items()}
    # Every deferred flush together, wherever it ran (in propose, at the DEFER_ROWS limit, at a release).
    flushes = [
        t for path, seconds in timer.samples.items() if path.rsplit("/", 1)[-1] == "context flush" for t in seconds
    ]
    context = {rows: context_write(drafter, rows, args.context_repeats) for rows in CONTEXT_ROWS}

    dtype = str(drafter.model.fc.weight.dtype).removeprefix("torch.")
    threads = torch.get_num_threads()
    acceptance = 1 + accepted / drafts if drafts else None
    print(
        f"{num_tokens} tokens in {wall:.2f} s ({num_tokens / wall:.1f} tok/s): {args.num_prompts} prompts x "
        f"{args.max_tokens} tokens, {'fixed k' if args.fixed_k else 'adaptive verification'}, {dtype}, "
        f"threads={threads}, {drafts} drafting rounds verified"
        + (f", mean acceptance length {acceptance:.2f}" if acceptance is not None else "")
    )
    print(f"{'part':32s} {'calls':>6s} {'median ms':>10s} {'min ms':>8s} {'mean ms':>8s} {'total ms':>9s}")

    def line(name: str, row: dict[str, float]) -> None:
        print(
            f"{name:32s} {row['calls']:6d} {row['median_ms']:10.2f} {row['min_ms']:8.2f} {row['mean_ms']:8.2f} "
            f"{row['total_ms']:9.1f}"
        )

    for path, row in parts.items():
        line("  " * path.count("/") + path.rsplit("/", 1)[-1], row)
    for kind, row in steps.items():
        line(f"step [{kind}]", row)
    if flushes:
        line("context flush (all)", summary(flushes))
    for rows, row in context.items():
        line(f"context write, {rows} row{'s' if rows > 1 else ''}", row)
    if not drafts:
        print("adaptive verification drafted in no step: --fixed-k times the drafting parts")

    if args.output_json:
        result = {
            "config": {
                "dataset": args.dataset,
                "num_prompts": args.num_prompts,
                "max_tokens": args.max_tokens,
                "fixed_k": args.fixed_k,
                "dtype": dtype,
                "threads": threads,
            },
            "tokens": num_tokens,
            "wall_s": wall,
            "num_drafts": drafts,
            "mean_acceptance_length": acceptance,
            "parts": parts,
            "steps_by_kind": steps,
            "context_flush_all": summary(flushes) if flushes else None,
            "context_write": {str(rows): row for rows, row in context.items()},
        }
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
