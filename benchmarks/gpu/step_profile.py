"""Where a step's wall time goes: the engine's phases timed on the host, per configuration and concurrency.

    python benchmarks/gpu/step_profile.py --device cuda --concurrency 1 256 --output step-profile.json

Each configuration (no speculation, DSpark fixed k = 7, DSpark adaptive, adaptive held to drafting or to plain steps)
gets one engine; C requests decode in steady state (ignore_eos, greedy unless --temperature) and N steps are timed
with every phase wrapped. A phase's time includes what it waits for on the device (the step's one download wait sits
in collect, launch (verification) or propose). With async scheduling (on by default on CUDA) a plain step's launch is
of the next step, before this one is collected.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import json
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from dspark import LLM, SamplingParams
from dspark.speculative import planner as planner_module
from dspark.speculative.drafters.base import Proposal

CONFIGS: dict[str, dict[str, Any] | None] = {
    "no-spec": None,
    "fixed-7": {"method": "dspark", "num_speculative_tokens": 7, "enable_adaptive_verification": False},
    "fixed-1": {"method": "dspark", "num_speculative_tokens": 1, "enable_adaptive_verification": False},
    # verification decided row by row on the host (verify()), as before verify_plain: the same tokens
    "fixed-7-rowwise": {"method": "dspark", "num_speculative_tokens": 7, "enable_adaptive_verification": False},
    "fixed-1-rowwise": {"method": "dspark", "num_speculative_tokens": 1, "enable_adaptive_verification": False},
    "adaptive": {"method": "dspark", "num_speculative_tokens": 7},
    # adaptive verification on every step: the regime held to drafting, so that each step plans (budget choice and
    # allocation, phase planner.plan) where the measured regime would run plain steps
    "adaptive-drafting": {"method": "dspark", "num_speculative_tokens": 7},
    # the regime held plain: what an adaptive engine's plain step costs beside a no-spec one
    "adaptive-plain": {"method": "dspark", "num_speculative_tokens": 7},
}


PLAN_PARTS = {fn: getattr(planner_module, fn) for fn in ("choose_budget", "allocate", "download")}


def wrap(obj: object, name: str, label: str, acc: collections.Counter[str]) -> None:
    f: Callable[..., Any] = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = f(*args, **kwargs)
        acc[label] += time.perf_counter() - start
        return out

    setattr(obj, name, timed)


def profile(
    name: str,
    device: str,
    concurrency: int,
    steps: int,
    cprofile: int = 0,
    max_num_batched_tokens: int = 8192,
    output_kind: str = "final_only",
    temperature: float = 0.0,
) -> dict[str, Any]:
    # A fixed KV cache: engines built one after another in one process must not size it from memory still held. It
    # holds every request's whole life (prompt, steps * 8 + 64 tokens, the drafter's lookahead) with room to spare.
    # The sweep's settings (bench sweep: 8192 batched tokens, final_only outputs): the default 2048 tokens would
    # let only 256 drafting requests (8 tokens each) into a step at C = 1024, and streamed outputs' per-request objects
    # would dominate a no-spec step's host time.
    llm = LLM(
        device=device,
        max_num_seqs=max(concurrency, 16),
        max_model_len=2048,
        max_num_batched_tokens=max_num_batched_tokens,
        num_kv_blocks=max(8192, concurrency * (steps * 8 + 128) // 16 + 256),
        speculative_config=CONFIGS[name],
    )
    engine = llm.engine
    engine.runner.plain_verify = not name.endswith("-rowwise")
    if name == "adaptive-drafting":
        assert engine.planner is not None
        engine.planner.regime.choose = lambda num_requests, model_says_draft: True  # type: ignore[method-assign]
    if name == "adaptive-plain":
        assert engine.planner is not None
        engine.planner.regime.choose = lambda num_requests, model_says_draft: False  # type: ignore[method-assign]
    params = SamplingParams(
        temperature=temperature, max_tokens=steps * 8 + 64, ignore_eos=True, output_kind=output_kind
    )
    for i in range(concurrency):
        engine.add_request(f"Question {i}: explain how a bicycle stays upright.", params)
    for _ in range(12):  # prefill and the first decode steps
        engine.step()
    acc: collections.Counter[str] = collections.Counter()
    wrap(engine.scheduler, "schedule", "schedule", acc)
    wrap(engine.runner, "launch", "launch", acc)  # inputs, graph replay, sampling queued
    wrap(engine.runner, "collect", "collect", acc)  # the wait for the step's tokens
    wrap(engine.runner, "propose", "propose", acc)  # queues the drafting pass; "draft wait" waits for its tokens
    wait = Proposal.token_ids.fget
    assert wait is not None

    def timed_wait(proposal: Proposal) -> list[list[int]]:
        start = time.perf_counter()
        out = wait(proposal)
        acc["draft wait"] += time.perf_counter() - start
        return out

    Proposal.token_ids = property(timed_wait)  # type: ignore[method-assign,assignment]
    wrap(engine.core, "_append", "process", acc)
    # Every event wait of the host (the step's download, a graph replay's staging copies, the planner's copies), inside
    # the phases above: a step's host work is its wall time less this ("busy" below).
    event_sync = torch.cuda.Event.synchronize

    def timed_sync(event: torch.cuda.Event) -> None:
        start = time.perf_counter()
        event_sync(event)
        acc["wait"] += time.perf_counter() - start

    torch.cuda.Event.synchronize = timed_sync  # type: ignore[method-assign]
    eager = collections.Counter()  # steps the CUDA graphs did not cover, by (tokens, requests, max query length)
    graphs = engine.runner.graphs
    if graphs is not None:
        pick = graphs.pick

        def counted_pick(num_tokens: int, num_reqs: int, max_query_len: int) -> tuple[int, int] | None:
            key = pick(num_tokens, num_reqs, max_query_len)
            if key is None:
                eager[f"{num_tokens}/{num_reqs}/{max_query_len}"] += 1
            return key

        graphs.pick = counted_pick  # type: ignore[method-assign]
    if engine.planner is not None:
        for fn in ("plan", "prepare", "record", "should_draft", "observe"):
            wrap(engine.planner, fn, f"planner.{fn}", acc)
        for fn in ("step_started", "step_finished"):
            wrap(engine.core.timer, fn, f"planner.{fn}", acc)
        # inside plan: the budget choice and the allocation (kernel, copy and wait), the goal's "under 2% of a step".
        # plan.choose_budget counts the choices made in prepare() too (while the drafting pass runs).
        for fn in PLAN_PARTS:
            wrap(planner_module, fn, f"plan.{fn}", acc)
    if device == "cuda":
        torch.cuda.synchronize()
    generated = engine.get_metrics()["num_generation_tokens"]
    # Each step's wall time by kind: "verify+draft", "plain" (neither), or "switch" (one of the two): an adaptive
    # engine's plain steps should cost what a no-spec step costs.
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    gc_started: list[float] = []

    def gc_timer(phase: str, info: dict[str, int]) -> None:  # the collector's pauses, by generation
        if phase == "start":
            gc_started.append(time.perf_counter())
        elif gc_started:
            acc[f"gc{info['generation']}"] += time.perf_counter() - gc_started.pop()

    gc.callbacks.append(gc_timer)
    profiler = cProfile.Profile() if cprofile else None
    if profiler is not None:
        profiler.enable()
    start = time.perf_counter()
    for _ in range(steps):
        proposed, drafts = acc["propose"], engine.stats["spec_decode_num_drafts"]
        t0 = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - t0) * 1e3
        drafted, verified = acc["propose"] > proposed, engine.stats["spec_decode_num_drafts"] > drafts
        by_kind["verify+draft" if drafted and verified else "switch" if drafted or verified else "plain"].append(ms)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    gc.callbacks.remove(gc_timer)
    if profiler is not None:  # where the host's time went (the wall times above include the profiler's overhead)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(cprofile)
    tokens = engine.get_metrics()["num_generation_tokens"] - generated
    phases = {k: v / steps * 1e3 for k, v in acc.most_common()}
    # the rest of step(): bookkeeping, drafting's own (plan.* sit inside planner.plan)
    phases["other"] = wall / steps * 1e3 - sum(
        v for k, v in phases.items() if not k.startswith("plan.") and not k.startswith("gc") and k != "wait"
    )
    phases["busy"] = wall / steps * 1e3 - phases.get("wait", 0.0)  # the host's own time a step
    row = {"config": name, "concurrency": concurrency, "temperature": temperature, "step_ms": wall / steps * 1e3}
    row["tokens_per_s"] = tokens / wall
    # requests in the timed steps (a row whose KV cache or token budget held requests back shows it here)
    row["num_running"] = len(engine.scheduler.running)
    row["max_num_batched_tokens"], row["output_kind"] = max_num_batched_tokens, output_kind
    row["eager_steps"] = dict(eager)
    # the spread too: a few slow steps, which the median hides, can be all of a configuration's loss
    row["steps_by_kind"] = {
        k: {
            "count": len(v),
            "median_ms": statistics.median(v),
            "p90_ms": sorted(v)[int(0.9 * (len(v) - 1))],
            "max_ms": max(v),
            "total_ms": sum(v),
        }
        for k, v in by_kind.items()
    }
    for fn, original in PLAN_PARTS.items():  # unwrapped again for the next engine
        setattr(planner_module, fn, original)
    Proposal.token_ids = property(wait)  # type: ignore[method-assign,assignment]
    torch.cuda.Event.synchronize = event_sync  # type: ignore[method-assign]
    del llm, engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row | {"phases_ms": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--config", nargs="+", default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--output", default=None)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the top N host functions")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--output-kind", default="final_only", choices=["final_only", "cumulative"])
    parser.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (1: sampled rows)")
    args = parser.parse_args()
    rows = []
    for name in args.config:
        for c in args.concurrency:
            row = profile(
                name,
                args.device,
                c,
                args.steps,
                args.cprofile,
                args.max_num_batched_tokens,
                args.output_kind,
                args.temperature,
            )
            rows.append(row)
            phases = ", ".join(f"{k} {v:.2f}" for k, v in row["phases_ms"].items())
            kinds = ", ".join(
                f"{k} {v['count']}x {v['median_ms']:.2f} (p90 {v['p90_ms']:.2f}, max {v['max_ms']:.2f}, total "
                f"{v['total_ms']:.0f})"
                for k, v in row["steps_by_kind"].items()
            )
            print(
                f"{name} C={c} ({row['num_running']} running): {row['step_ms']:.2f} ms/step, "
                f"{row['tokens_per_s']:.0f} tok/s | {phases}",
                flush=True,
            )
            print(f"{name} C={c}: median step by kind: {kinds}; eager steps {row['eager_steps']}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
