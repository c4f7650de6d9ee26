"""One row of `dspark bench sweep` through one engine: the prompts with at most C in flight, and what the row
measured (a Round: times, token counts, the engine's counter deltas, step times by kind). hf_arm.py makes the same
Round from transformers."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from dspark.config import SamplingParams
from dspark.engine.llm_engine import LLMEngine
from dspark.outputs import RequestOutput

COUNTERS = (
    "num_preemptions",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_steps_without_drafting",
    "num_pipelined_steps",  # async scheduling: steps launched before the previous one was collected
)


@dataclass
class Round:
    elapsed_s: float
    num_input_tokens: int
    num_output_tokens: int
    max_in_flight: int
    ttft_s: list[float]
    tpot_s: list[float]  # requests with more than one output token
    e2el_s: list[float]
    counters: dict[str, float]  # COUNTERS' deltas over the round, the planner's budget sum and step count; {} for hf
    # adaptive: the regime's measured tokens/ms per load level at the round's end (speculative/regime.py), for diagnosis
    regime_rates: dict[int, dict[str, float]] | None = None
    # adaptive: per load level, the round's steps that drafted ("spec") and that did not ("plain")
    regime_steps: dict[int, dict[str, int]] | None = None
    # wall ms of each step, by what it ran (engine.step_kind): where a row's time went
    step_ms: dict[str, list[float]] = field(default_factory=dict)
    # the speculative steps (they drafted or verified; a step with a prompt chunk counts as "prefill", not here), in
    # order: [step in the row, requests running before it, kind, wall ms], the first SPEC_STEPS_KEPT: when and at what
    # load a row drafted
    spec_steps: list[list[Any]] = field(default_factory=list)
    # CUDA: the device ms of each step launched in the row (worker's device_steps)
    device_ms: list[float] = field(default_factory=list)

    @property
    def output_throughput(self) -> float:
        return self.num_output_tokens / self.elapsed_s


SPEC_STEPS_KEPT = 64
SPEC_KINDS = ("draft", "verify", "verify+draft")  # engine.step_kind of a speculative step


def run_row(
    engine: LLMEngine, prompt_ids: list[list[int]], params: SamplingParams, concurrency: int, label: str
) -> tuple[Round, list[list[int]]]:
    """The prompts through the engine with at most `concurrency` in flight; the round and the outputs in order."""
    engine.kv.reset_prefix_cache()  # every row starts cold
    before = _counters(engine)
    steps_before = _regime_steps(engine)
    bar = tqdm(total=len(prompt_ids) * (params.max_tokens or 0), desc=label, unit="tok", file=sys.stderr, leave=False)
    ids: list[str] = []
    final: dict[str, RequestOutput] = {}

    def submit() -> None:
        i = len(ids)
        ids.append(engine.add_request(prompt_ids[i], dataclasses.replace(params, seed=i)))

    step_ms: dict[str, list[float]] = {}
    spec_steps: list[list[Any]] = []
    runner = engine.runner
    timed = runner.device.type == "cuda"
    if timed:
        runner.device_steps = []
    start = time.perf_counter()
    while len(ids) < min(concurrency, len(prompt_ids)):
        submit()
    max_in_flight = engine.num_unfinished_requests
    num_steps = 0
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)  # before the step: admissions in it are not counted
        step_start = time.perf_counter()
        outputs = engine.step()
        ms = (time.perf_counter() - step_start) * 1e3
        kind = engine.last_step_kind
        step_ms.setdefault(kind, []).append(ms)
        if kind in SPEC_KINDS and len(spec_steps) < SPEC_STEPS_KEPT:
            spec_steps.append([num_steps, running, kind, round(ms, 3)])
        num_steps += 1
        for out in outputs:
            bar.update(len(out.new_token_ids))
            if out.finished:
                final[out.request_id] = out
                if len(ids) < len(prompt_ids):
                    submit()
        max_in_flight = max(max_in_flight, engine.num_unfinished_requests)
    elapsed = time.perf_counter() - start
    bar.close()
    device_ms: list[float] = []
    if timed:
        torch.cuda.synchronize(runner.device)
        device_ms = runner.take_device_ms()
        runner.device_steps = None
    after = _counters(engine)
    outs = [final[i] for i in ids]
    ttft, tpot, e2el = [], [], []
    for out in outs:
        m = out.metrics
        assert m.first_token_time is not None and m.finished_time is not None
        ttft.append(m.first_token_time - m.arrival_time)
        e2el.append(m.finished_time - m.arrival_time)
        if m.num_generation_tokens > 1:
            tpot.append((e2el[-1] - ttft[-1]) / (m.num_generation_tokens - 1))
    token_ids = [o.outputs[0].token_ids for o in outs]
    round_ = Round(
        elapsed,
        sum(len(p) for p in prompt_ids),
        sum(len(t) for t in token_ids),
        max_in_flight,
        ttft,
        tpot,
        e2el,
        {k: after[k] - before[k] for k in after},
        engine.planner.regime.rates() if engine.planner is not None and engine.planner.adaptive else None,
        _steps_delta(steps_before, _regime_steps(engine)),
        step_ms,
        spec_steps,
        device_ms,
    )
    return round_, token_ids


def _regime_steps(engine: LLMEngine) -> dict[int, dict[str, int]] | None:
    planner = engine.planner
    if planner is None or not planner.adaptive:
        return None
    return {lvl: dict(n) for lvl, n in planner.regime.num_chosen.items()}


def _steps_delta(
    before: dict[int, dict[str, int]] | None, after: dict[int, dict[str, int]] | None
) -> dict[int, dict[str, int]] | None:
    if before is None or after is None:
        return None
    zero = {"spec": 0, "plain": 0}
    delta = {lvl: {k: n[k] - before.get(lvl, zero)[k] for k in n} for lvl, n in after.items()}
    return {lvl: n for lvl, n in delta.items() if any(n.values())}


def _counters(engine: LLMEngine) -> dict[str, float]:
    metrics = engine.get_metrics()
    counters = {k: metrics.get(k, 0) for k in COUNTERS}
    # get_metrics() has the verify budget as a mean over the engine's life; its sum and step count give a row's.
    planner = engine.planner
    counters["verify_budget_sum"] = planner.sum_budget if planner is not None else 0
    counters["num_planned_steps"] = planner.num_planned_steps if planner is not None else 0
    counters["plan_ms"] = planner.plan_ms_total if planner is not None else 0.0
    counters["num_steps"] = metrics.get("num_steps", 0)
    return counters


def step_medians(r: Round) -> dict[str, float]:
    return {kind: round(statistics.median(ms), 3) for kind, ms in r.step_ms.items() if ms}
