"""Where a prefill step's time goes, no-spec against adaptive DSpark: the engine's phases timed on the host.

    python benchmarks/gpu/prefill_profile.py --device cuda --concurrency 1 16 --repeats 20

It tells a gap between adaptive's and no-spec's prefill steps that the engine causes (the drafter's eager context
write) from one that host contention causes in a sweep. Its runs are in benchmarks/results/h200/gpu-path/.

Each repeat adds C prompts to an idle engine, times the step that prefills them (every phase wrapped), and runs them
to the end (32 tokens: the next prefill follows a decode run, as in a sweep row). A phase's time includes what it
waits for on the device.
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import time
from typing import Any

import torch

from dspark import LLM, SamplingParams
from dspark.bench.rounds import run_row
from dspark.bench.sweep import WARMUP_TOKENS, num_prompts_for, sweep_prompts
from dspark.bench.throughput import drain, tokenize

CONFIGS: dict[str, dict[str, Any] | None] = {"no-spec": None, "adaptive": {"method": "dspark"}}


def wrap(obj: object, name: str, acc: collections.Counter[str], label: str) -> None:
    f = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            acc[label] += (time.perf_counter() - start) * 1e3

    setattr(obj, name, timed)


def trace_step(
    engine: Any, prompts: list[str], params: SamplingParams, concurrency: int, name: str, first: int
) -> None:
    """One more prefill step under torch.profiler: the host ops and device kernels that take its time. Prompts from
    `first` on, past those the repeats used: a prompt seen before hits the prefix cache, and its "prefill" is a
    one-token graph replay."""
    for i in range(concurrency):
        engine.add_request(prompts[(first + i) % len(prompts)], params)
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60)
    print(f"== trace {name} C={concurrency} (by host time)\n{table}", flush=True)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)
    print(f"== trace {name} C={concurrency} (by self host time)\n{table}", flush=True)


def profile(
    name: str,
    device: str,
    concurrency: int,
    repeats: int,
    prompts: list[str],
    async_scheduling: bool | None,
    trace: bool = False,
) -> dict[str, Any]:
    llm = LLM(
        device=device,
        max_num_seqs=max(concurrency, 16),
        max_model_len=2048,
        num_kv_blocks=8192,
        max_num_batched_tokens=8192,
        speculative_config=CONFIGS[name],
        async_scheduling=async_scheduling,
    )
    engine = llm.engine
    acc: collections.Counter[str] = collections.Counter()
    wrap(engine.scheduler, "schedule", acc, "schedule")
    wrap(engine.runner, "launch", acc, "launch")
    wrap(engine.runner, "collect", acc, "collect")
    wrap(engine.core, "_append", acc, "process")
    wrap(engine.core, "_draft", acc, "draft")
    if engine.runner.drafter is not None:
        wrap(engine.runner.drafter, "extend_context", acc, "drafter.extend_context")
        wrap(engine.runner, "propose", acc, "propose")
    if engine.planner is not None:
        for fn in ("plan", "should_draft", "record", "observe"):
            wrap(engine.planner, fn, acc, f"planner.{fn}")
        for fn in ("step_started", "step_finished"):
            wrap(engine.core.timer, fn, acc, f"planner.{fn}")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    steps, phases, every = [], collections.defaultdict(list), []
    for r in range(repeats + 2):  # the first two warm up (compiles)
        ids = [engine.add_request(prompts[(r * concurrency + i) % len(prompts)], params) for i in range(concurrency)]
        if device == "cuda":
            torch.cuda.synchronize()
        acc.clear()
        start = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - start) * 1e3
        every.append(round(ms, 2))
        prefill_phases = dict(acc)
        kind = engine.last_step_kind
        while engine.has_unfinished_requests():
            engine.step()
        assert not any(rid in engine.output_processor.states for rid in ids)
        if trace and r == repeats + 1:  # after the last repeat, one more under torch.profiler
            trace_step(engine, prompts, params, concurrency, name, (repeats + 2) * concurrency)
        if r >= 2:
            steps.append(ms)
            for k, v in prefill_phases.items():
                phases[k].append(v)
    row = {"config": name, "concurrency": concurrency, "prefill_step_ms": statistics.median(steps), "every_ms": every}
    by_total = sorted(phases.items(), key=lambda kv: -sum(kv[1]))
    row["phases_ms"] = {k: round(statistics.median(v), 3) for k, v in by_total}
    print(
        f"{name} C={concurrency} async={async_scheduling}: prefill step {row['prefill_step_ms']:.2f} ms "
        f"(median of {repeats}; kind {kind}) | " + ", ".join(f"{k} {v:.2f}" for k, v in row["phases_ms"].items()),
        flush=True,
    )
    print(f"  every repeat (2 warm-ups first): {every}", flush=True)
    del llm, engine
    return row


def sweep_like(name: str, device: str, concurrency: int, rounds: int, prompts: list[str], output_len: int) -> None:
    """A sweep row's conditions exactly (bench sweep's engine settings, warm-up and run_row): every step timed with
    its phases and the garbage collector's pauses, and the prefill steps printed one by one."""
    llm = LLM(
        device=device,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.6,
        speculative_config=CONFIGS[name] and {**CONFIGS[name], "num_speculative_tokens": 7},
    )
    engine = llm.engine
    acc: collections.Counter[str] = collections.Counter()
    gc_start: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_start.append(time.perf_counter())
        elif gc_start:
            acc[f"gc{info['generation']}"] += (time.perf_counter() - gc_start.pop()) * 1e3

    gc.callbacks.append(on_gc)
    wrap(engine.scheduler, "schedule", acc, "schedule")
    wrap(engine.runner, "launch", acc, "launch")
    wrap(engine.runner, "_forward_eager", acc, "launch.forward_eager")
    wrap(engine.runner, "collect", acc, "collect")
    wrap(engine.core, "_append", acc, "process")
    wrap(engine.core, "_draft", acc, "draft")
    wrap(engine.core.policy, "next_step", acc, "continuation")
    wrap(engine.kv, "cache_computed_blocks", acc, "kv.cache_computed_blocks")
    if engine.runner.drafter is not None:
        wrap(engine.runner.drafter, "extend_context", acc, "launch.extend_context")
    if engine.planner is not None:
        for fn in ("plan", "should_draft", "record", "release"):
            wrap(engine.planner, fn, acc, f"planner.{fn}")
        for fn in ("step_started", "step_finished", "skip_timing"):
            wrap(engine.core.timer, fn, acc, f"planner.{fn}")
    steps: list[tuple[str, float, dict[str, float]]] = []
    step = engine.step

    def timed_step() -> Any:
        acc.clear()
        start = time.perf_counter()
        out = step()
        steps.append((engine.last_step_kind, (time.perf_counter() - start) * 1e3, dict(acc)))
        return out

    engine.step = timed_step  # type: ignore[method-assign]
    ids = tokenize(llm, prompts[: num_prompts_for(concurrency, None, 1)], True)
    engine.add_request(ids[0], SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True, seed=0))
    drain(engine)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind="final_only")
    for r in range(rounds):
        steps.clear()
        round_, _ = run_row(engine, ids, params, concurrency, f"{name} C={concurrency}")
        by_kind: dict[str, list[float]] = collections.defaultdict(list)
        gc_ms: collections.Counter[str] = collections.Counter()
        for kind, ms, phases in steps:
            by_kind[kind].append(ms)
            gc_ms.update({k: v for k, v in phases.items() if k.startswith("gc")})
        print(
            f"SWEEP-LIKE {name} C={concurrency} round {r + 1}: {round_.output_throughput:.0f} tok/s | "
            + ", ".join(f"{k} {len(v)} steps median {statistics.median(v):.2f} ms" for k, v in by_kind.items())
            + f" | gc {dict((k, round(v, 1)) for k, v in gc_ms.items())}",
            flush=True,
        )
        for i, (kind, ms, phases) in enumerate(steps):
            if kind == "prefill" or ms > 5:
                top = sorted(phases.items(), key=lambda kv: -kv[1])[:8]
                prev = steps[i - 1][0] if i else "-"
                print(f"  step {i} {kind} (after {prev}) {ms:.2f} ms | " + ", ".join(f"{k} {v:.2f}" for k, v in top))
    gc.callbacks.remove(on_gc)
    engine.step = step  # type: ignore[method-assign]
    gc.unfreeze()  # the engine froze the GC heap (engine.py): frozen, the engine is never collected
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--data-dir", help="prompt sets laid out as ../shared/data (default: that, if there)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--trace", action="store_true", help="also one prefill step under torch.profiler (CUDA)")
    parser.add_argument("--sweep-like", type=int, metavar="ROUNDS", help="instead: sweep rows, every step timed")
    parser.add_argument("--output-len", type=int, default=256, help="with --sweep-like")
    args = parser.parse_args()
    prompts = sweep_prompts([], args.data_dir).prompts
    if args.sweep_like:
        for c in args.concurrency:
            for name in CONFIGS:
                sweep_like(name, args.device, c, args.sweep_like, prompts, args.output_len)
        return
    for c in args.concurrency:
        for name in CONFIGS:
            profile(name, args.device, c, args.repeats, prompts, args.async_scheduling, args.trace)


if __name__ == "__main__":
    main()
