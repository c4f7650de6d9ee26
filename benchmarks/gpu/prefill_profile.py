"""Where a prefill step's time goes, no-spec against adaptive DSpark: the engine's phases timed on the host.

    python benchmarks/gpu/prefill_profile.py --device cuda --concurrency 1 16 --repeats 20

On the H200 (session 3, results/h200/gpu-path/2026-11-30-s3) adaptive's prefill steps took 11-16 ms more than
no-spec's whatever their size (26.7 against 13.8 ms for one prompt, 30.8 against 14.9 for 16), while neither drafted.
Each repeat adds C prompts to an idle engine, times the step that prefills them (every phase wrapped), and runs them
to the end (32 tokens: the next prefill follows a decode run, as in a sweep row). A phase's time includes what it
waits for on the device.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Any

import torch

from dspark import LLM, SamplingParams
from dspark.bench.sweep import sweep_prompts

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


def profile(
    name: str, device: str, concurrency: int, repeats: int, prompts: list[str], async_scheduling: bool | None
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
    wrap(engine, "_process", acc, "process")
    if engine.runner.drafter is not None:
        wrap(engine.runner.drafter, "extend_context", acc, "drafter.extend_context")
        wrap(engine.runner, "propose", acc, "propose")
    if engine.planner is not None:
        for fn in ("plan", "should_draft", "step_started", "step_finished", "record", "observe"):
            wrap(engine.planner, fn, acc, f"planner.{fn}")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    steps, phases = [], collections.defaultdict(list)
    for r in range(repeats + 2):  # the first two warm up (compiles)
        ids = [engine.add_request(prompts[(r * concurrency + i) % len(prompts)], params) for i in range(concurrency)]
        if device == "cuda":
            torch.cuda.synchronize()
        acc.clear()
        start = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - start) * 1e3
        prefill_phases = dict(acc)
        while engine.has_unfinished_requests():
            engine.step()
        assert not any(rid in engine._tracked for rid in ids)
        if r >= 2:
            steps.append(ms)
            for k, v in prefill_phases.items():
                phases[k].append(v)
    row = {"config": name, "concurrency": concurrency, "prefill_step_ms": statistics.median(steps)}
    by_total = sorted(phases.items(), key=lambda kv: -sum(kv[1]))
    row["phases_ms"] = {k: round(statistics.median(v), 3) for k, v in by_total}
    print(
        f"{name} C={concurrency}: prefill step {row['prefill_step_ms']:.2f} ms (median of {repeats}) | "
        + ", ".join(f"{k} {v:.2f}" for k, v in row["phases_ms"].items()),
        flush=True,
    )
    del llm, engine
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--data-dir", help="prompt sets laid out as ../shared/data (default: that, if there)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args()
    prompts = sweep_prompts([], args.data_dir).prompts
    for c in args.concurrency:
        for name in CONFIGS:
            profile(name, args.device, c, args.repeats, prompts, args.async_scheduling)


if __name__ == "__main__":
    main()
