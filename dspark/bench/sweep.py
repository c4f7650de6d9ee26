"""`dspark bench sweep`: no speculation, fixed k and adaptive verification, across concurrencies, in one run.

Offline: one fixed prompt set in a fixed order (GSM8K test questions, MT-bench first turns and HumanEval prompts
interleaved, from ../shared/data or --data-dir; else the built-in set; or --dataset-path files interleaved), every
request decodes exactly `output_len` tokens (ignore_eos: the work per request is the same for every arm, so tokens/s
compare like with like; acceptance is measured on what the model writes past EOS too). Each arm's engine is built once
per round with max_num_seqs = the largest concurrency and reused for every row; concurrency C means at most C requests
in the engine: C are submitted, and another whenever one finishes, until the row's prompts are done. Rows start with a
cold prefix cache. Per request, sampled rows draw with seed = the request's index in the row, the same in every arm.
With --hf, Hugging Face transformers' continuous batching runs the same prompt token ids on the same weights as arm
`hf`, after the engines of each round (hf_arm.py says how).

A row is (arm, concurrency, temperature). Its counters are deltas of engine.get_metrics() over the row:
- acceptance_length = 1 + accepted drafts / drafts (vLLM's);
- mean_verify_len = drafts verified per request-step: a request-step emits its accepted drafts plus one token, so
  request-steps = output tokens - accepted drafts, and steps that verified nothing (the prefill's token, steps after
  adaptive verification chose none) count as 0.
With --repeats R the arms alternate round by round (each round builds every arm's engine again); every key of a row
is its median round's (by output throughput; the lower middle one for even R), rounds_output_throughput lists all.
With --interleave every arm's engine is built once, with its share of the memory budget, and the arms take turns row
by row (the first of each row rotating by round), so that a slow stretch of the host falls on all arms alike; an
engine then keeps what it learned (adaptive's measured rates) from round to round.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from dspark.bench.prompts import BUILTIN_PROMPTS
from dspark.bench.throughput import build_hf_model, drain, machine_info, read_jsonl_prompts, tokenize
from dspark.cli import add_engine_args, engine_config, output_path, write_json
from dspark.config import MAX_SPECULATIVE_TOKENS, EngineConfig, SamplingParams, SpeculativeConfig
from dspark.engine.llm_engine import LLMEngine
from dspark.errors import ConfigError
from dspark.llm import LLM
from dspark.outputs import RequestOutput

if TYPE_CHECKING:
    from dspark.bench.hf_arm import HFArm

ARMS = ("no-spec", "fixed-1", "fixed-3", "fixed-5", "fixed-7", "adaptive")
CONCURRENCIES = (1, 16, 32, 64, 128, 256, 512, 1024)
TEMPERATURES = (1.0, 0.0)
ADAPTIVE_K = 7  # the adaptive arm's cap on drafts per request and step: the largest default fixed k
MIN_PROMPTS = 16
WARMUP_TOKENS = 4
COUNTERS = (
    "num_preemptions",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_steps_without_drafting",
    "num_pipelined_steps",  # async scheduling: steps launched before the previous one was collected
)
HF = "hf"  # the Hugging Face transformers arm
HF_MAX_CONCURRENCY = 256  # the hf arm's default concurrencies are the sweep's up to this: it is slow above
DATA_DIR_ENV = "DSPARK_DATA_DIR"
REPO_DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"  # ../shared/data beside a source checkout
# The default prompt mix, interleaved in this order: per source, the first file the data directory has (DeepSpec's
# chat-ready copy, else the raw set; layout and licences in ../shared/data/MANIFEST.md).
DEFAULT_MIX = (
    ("gsm8k", ("deepspec_eval/gsm8k.jsonl", "gsm8k/test.jsonl")),  # the 1319 test questions
    ("mt-bench", ("deepspec_eval/mt-bench.jsonl", "mt_bench/question.jsonl")),  # 80 first turns
    ("humaneval", ("deepspec_eval/humaneval.jsonl", "humaneval/HumanEval.jsonl.gz")),  # 164 problems
)
RowKey = tuple[str, int, float]  # (arm, concurrency, temperature)


SYNC = ":sync"  # an arm's suffix: the same arm with async scheduling off (its gain, measured in the same run)
# adaptive's engine with its regime held plain: what keeping the drafter's context costs a plain step, beside no-spec
HELD_PLAIN = "adaptive:plain"


@dataclass(frozen=True)
class Arm:
    name: str
    k: int | None  # fixed drafts per request and step; None: no-spec, or adaptive (up to the config's k, else 7)
    adaptive: bool = False
    sync: bool = False  # async scheduling off (name ends in SYNC)
    held_plain: bool = False  # adaptive's engine that never drafts (HELD_PLAIN)

    @property
    def speculates(self) -> bool:
        return self.k is not None or self.adaptive

    def config(self, base: EngineConfig, spec: SpeculativeConfig) -> EngineConfig:
        if self.sync:
            base = dataclasses.replace(base, async_scheduling=False)
        if not self.speculates:
            return dataclasses.replace(base, speculative_config=None)
        k = self.k or spec.num_speculative_tokens or ADAPTIVE_K
        arm_spec = dataclasses.replace(spec, num_speculative_tokens=k, enable_adaptive_verification=self.adaptive)
        return dataclasses.replace(base, speculative_config=arm_spec)


def parse_arm(name: str) -> Arm:
    base = name.removesuffix(SYNC)
    sync = base != name
    if base in ("no-spec", "adaptive", HELD_PLAIN):
        return Arm(name, None, adaptive=base != "no-spec", sync=sync, held_plain=base == HELD_PLAIN)
    k = base.removeprefix("fixed-")
    if k != base and k.isdigit() and 1 <= int(k) <= MAX_SPECULATIVE_TOKENS:
        return Arm(name, int(k), sync=sync)
    raise ConfigError(
        "arm",
        name,
        f"one of no-spec, fixed-K (K in 1..{MAX_SPECULATIVE_TOKENS}), adaptive, {HELD_PLAIN}, each optionally with "
        f"{SYNC} (async scheduling off) (transformers: --hf)",
    )


@dataclass(frozen=True)
class PromptSet:
    name: str  # "builtin", "dataset-path" or the default mix's sources ("gsm8k+mt-bench+humaneval")
    files: list[str]
    prompts: list[str]  # in the fixed order

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "files": self.files, "num_prompts": len(self.prompts)}


def sweep_prompts(dataset_paths: list[str], data_dir: str | None = None) -> PromptSet:
    """The prompt set in its fixed order. The --dataset-path files' prompts interleaved (the first of each file, then
    the second, ...); else the default mix from the data directory (data_dir, else $DSPARK_DATA_DIR, else
    ../shared/data beside the checkout), interleaved the same way; else, when no data directory was named and the
    default one is absent, the built-in set shuffled once with seed 0 (so any prefix mixes math, code and chat)."""
    if dataset_paths:
        files = [Path(p) for p in dataset_paths]
        return PromptSet("dataset-path", [str(f) for f in files], _interleave(files))
    named = data_dir or os.environ.get(DATA_DIR_ENV)
    root = Path(named) if named else REPO_DATA_DIR
    found = [(name, f) for name, paths in DEFAULT_MIX if (f := _first_file(root, paths)) is not None]
    if found:
        files = [f for _, f in found]
        return PromptSet("+".join(name for name, _ in found), [str(f) for f in files], _interleave(files))
    wanted = ", ".join(" or ".join(paths) for _, paths in DEFAULT_MIX)
    if named:
        field = "data_dir" if data_dir else DATA_DIR_ENV
        raise ConfigError(field, named, f"a directory laid out as ../shared/data, holding {wanted}")
    print(
        f"note: no prompt data at {root} (--data-dir or ${DATA_DIR_ENV} name one): using the built-in prompts",
        file=sys.stderr,
    )
    prompts = list(BUILTIN_PROMPTS)
    random.Random(0).shuffle(prompts)
    return PromptSet("builtin", [], prompts)


def _first_file(root: Path, paths: tuple[str, ...]) -> Path | None:
    return next((root / p for p in paths if (root / p).is_file()), None)


def _interleave(files: list[Path]) -> list[str]:
    sources = [read_jsonl_prompts(f) for f in files]
    return [s[i] for i in range(max(len(s) for s in sources)) for s in sources if i < len(s)]


def num_prompts_for(concurrency: int, num_prompts: int | None, waves: int = 2) -> int:
    """Prompts of a row: the given number, else `waves` waves of the concurrency and at least MIN_PROMPTS."""
    return num_prompts if num_prompts is not None else max(waves * concurrency, MIN_PROMPTS)


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
    # NOTE: get_metrics() has the verify budget as a mean over the engine's life; its sum and step count give a row's.
    planner = engine.planner
    counters["verify_budget_sum"] = planner.sum_budget if planner is not None else 0
    counters["num_planned_steps"] = planner.num_planned_steps if planner is not None else 0
    counters["plan_ms"] = planner.plan_ms_total if planner is not None else 0.0
    counters["num_steps"] = metrics.get("num_steps", 0)
    return counters


@dataclass
class Sweep:
    result: dict[str, Any]  # what --output-json writes
    token_ids: dict[RowKey, list[list[int]]]  # each row's outputs in prompt order, last round (not in the JSON)


def run_sweep(
    config: EngineConfig,
    *,
    arms: list[str] | None = None,
    concurrencies: list[int] | None = None,
    temperatures: list[float] | None = None,
    output_len: int = 256,
    num_prompts: int | None = None,
    dataset_paths: list[str] | None = None,
    data_dir: str | None = None,
    chat: bool = True,
    repeats: int = 1,
    hf: bool = False,
    hf_concurrencies: list[int] | None = None,
    command: str = "",
    waves: int = 2,
    interleave: bool = False,
) -> Sweep:
    """Every arm at every concurrency and temperature, and the hf arm (hf, or hf_concurrencies given) at its
    concurrencies. config.speculative_config is the method and drafter of the speculative arms (default: n-gram);
    config.max_num_seqs is replaced by the largest concurrency. interleave: every arm's engine is built once and
    lives through the run (each with its share of gpu_memory_utilization), and the arms take turns row by row;
    otherwise each round builds each arm's engine in turn, which runs all its rows."""
    arm_list = [parse_arm(a) for a in dict.fromkeys(arms or ARMS)]
    for c in concurrencies or ():
        _check_positive("concurrency", c)
    concs = sorted(set(concurrencies or CONCURRENCIES))
    hf_concs = _hf_concurrencies(hf, hf_concurrencies, concs)
    temps = list(dict.fromkeys(TEMPERATURES if temperatures is None else temperatures))
    if not temps:
        raise ConfigError("temperature", temps, "give at least one")
    for t in temps:
        SamplingParams(temperature=t)  # names the field if it is out of range
    _check_positive("output_len", output_len)
    _check_positive("repeats", repeats)
    if num_prompts is not None:
        _check_positive("num_prompts", num_prompts)
    if hf_concs:
        # NOTE: imported here, not at the top: hf_arm builds on this module's Round.
        from dspark.bench.hf_arm import HFArm, require_continuous_batching

        require_continuous_batching()  # before any model is loaded
    prompts = sweep_prompts(dataset_paths or [], data_dir)
    _check_positive("waves", waves)
    sizes = {c: num_prompts_for(c, num_prompts, waves) for c in concs}
    base = dataclasses.replace(config, max_num_seqs=max(concs))
    spec = config.spec or SpeculativeConfig(method="ngram")

    rounds: dict[RowKey, list[Round]] = {}
    token_ids: dict[RowKey, list[list[int]]] = {}
    set_ids: list[list[int]] = []
    arm_configs: dict[str, Any] = {}
    hf_arm: HFArm | None = None
    device = dtype = ""

    def record(arm: str, c: int, t: float, label: str, outcome: tuple[Round, list[list[int]]]) -> None:
        round_, token_ids[arm, c, t] = outcome
        rounds.setdefault((arm, c, t), []).append(round_)
        # NOTE: the raw round on one line too, so a run cut short by a time limit still has every finished row.
        raw = {"arm": arm, "concurrency": c, "temperature": t, "elapsed_s": round_.elapsed_s}
        raw |= {"output_tokens": round_.num_output_tokens, "counters": round_.counters}
        raw["step_median_ms"] = _step_medians(round_)
        print(f"{label}: {round_.output_throughput:.1f} tok/s ROW {json.dumps(raw)}", file=sys.stderr)

    def build(arm: Arm, share: float = 1.0) -> LLM:
        """The arm's engine, warmed up. share: the fraction of --gpu-memory-utilization it may take up to, counting
        the engines already built (they all live at once under --interleave)."""
        nonlocal set_ids, device, dtype, hf_arm
        arm_config = arm.config(base, spec)
        arm_config = dataclasses.replace(arm_config, gpu_memory_utilization=base.gpu_memory_utilization * share)
        llm = LLM(**dataclasses.asdict(arm_config))
        engine = llm.engine
        if arm.held_plain:
            assert engine.planner is not None
            engine.planner.regime.held = False
        if not set_ids:  # tokenized once, for every arm: the prompts the largest row uses
            set_ids = tokenize(llm, prompts.prompts[: max(sizes.values())], chat)
            _check_fits(set_ids, output_len, engine.max_model_len)
            device, dtype = str(engine.device), str(engine.dtype).removeprefix("torch.")
            if hf_concs:  # the engine's own weights, copied once to the CPU
                hf_model = build_hf_model(engine.model, torch.device("cpu"), engine.dtype)
                hf_arm = HFArm(hf_model, engine.device, base.max_num_batched_tokens, base.enable_prefix_caching)
        arm_configs[arm.name] = dataclasses.asdict(arm_config.spec) if arm_config.spec else None
        warm = [SamplingParams(temperature=t, max_tokens=WARMUP_TOKENS, ignore_eos=True, seed=0) for t in temps]
        for p in warm:
            engine.add_request(set_ids[0], p)
        drain(engine)
        return llm

    def row(arm: Arm, engine: LLMEngine, c: int, t: float, r: int) -> None:
        params = SamplingParams(temperature=t, max_tokens=output_len, ignore_eos=True, output_kind="final_only")
        label = f"{arm.name} C={c} T={t} r{r + 1}"
        record(arm.name, c, t, label, run_row(engine, _row_ids(set_ids, sizes[c]), params, c, label))

    def release() -> None:
        gc.unfreeze()  # NOTE: the engine froze the GC heap (engine.py); a frozen cycle is never collected
        gc.collect()  # NOTE: the next arm's engine sizes its KV cache from the memory this one frees
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    def hf_rows(r: int) -> None:
        if hf_arm is None:
            return
        with hf_arm.on_device():  # after the engines are gone, so transformers has the device to itself
            for t in temps:
                hf_arm.warm_up(set_ids[0], t, WARMUP_TOKENS)
                for c in hf_concs:
                    label = f"{HF} C={c} T={t} r{r + 1}"
                    record(HF, c, t, label, hf_arm.run_row(_row_ids(set_ids, sizes[c]), t, output_len, c, label))

    if interleave:
        # Every arm's engine at once, each its share of the memory budget; the arms take turns row by row, the
        # first of each row rotating by round. NOTE: on the H200 the host runs stretches of seconds up to 1.7x
        # slower (session 7: same-config engines 2.5 against 3.6-4.5 ms a step at C = 256); whole engines in turn
        # put such a stretch on one arm's rows, rows in turn share it.
        llms = {arm.name: build(arm, (i + 1) / len(arm_list)) for i, arm in enumerate(arm_list)}
        for r in range(repeats):
            for t in temps:
                for c in concs:
                    for i in range(len(arm_list)):
                        arm = arm_list[(i + r) % len(arm_list)]
                        row(arm, llms[arm.name].engine, c, t, r)
        del llms
        release()
        for r in range(repeats):
            hf_rows(r)
    else:
        for r in range(repeats):
            for arm in arm_list:
                llm = build(arm)
                for t in temps:
                    for c in concs:
                        row(arm, llm.engine, c, t, r)
                del llm
                release()
            hf_rows(r)

    all_arms = [*arm_list, Arm(HF, None)] if hf_arm is not None else arm_list
    keys = [(a, c, t) for t in temps for c in concs for a in all_arms if (a.name, c, t) in rounds]
    rows = [_row(a, c, t, rounds[a.name, c, t]) for a, c, t in keys]
    for row in rows:
        base_ids = token_ids.get(("no-spec", row["concurrency"], row["temperature"]))
        if row["temperature"] == 0 and base_ids is not None:
            mine = token_ids[row["arm"], row["concurrency"], row["temperature"]]
            row["identical_to_no_spec"] = f"{sum(a == b for a, b in zip(mine, base_ids, strict=True))}/{len(mine)}"
    if hf_arm is not None:
        arm_configs[HF] = hf_arm.settings(hf_concs)
    result = {
        "command": command,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device,
        "dtype": dtype,
        "machine": machine_info(torch.device(device)),  # at the end: its load average covers the run
        "config": {
            "model": config.model,
            "engine": dataclasses.asdict(dataclasses.replace(base, speculative_config=None)),
            "arms": arm_configs,
            "prompt_set": prompts.to_json(),
            "num_unique_prompts": len(set_ids),
            "num_prompts": {str(c): n for c, n in sizes.items()},
            "output_len": output_len,
            "ignore_eos": True,
            "concurrencies": concs,
            "temperatures": temps,
            "chat": chat,
            "repeats": repeats,
            "interleave": interleave,
        },
        "rows": rows,
    }
    return Sweep(result, token_ids)


def _row_ids(set_ids: list[list[int]], num_prompts: int) -> list[list[int]]:
    """A row's prompts: the set's first num_prompts, the set repeating if it is shorter."""
    return [set_ids[i % len(set_ids)] for i in range(num_prompts)]


def _hf_concurrencies(hf: bool, given: list[int] | None, concs: list[int]) -> list[int]:
    """The hf arm's concurrencies: none unless asked for; the given ones, each one of the sweep's; else the sweep's up
    to HF_MAX_CONCURRENCY."""
    if given is None:
        chosen = [c for c in concs if c <= HF_MAX_CONCURRENCY] if hf else []
        if hf and not chosen:
            raise ConfigError(
                "hf_concurrency", None, f"name some: every sweep concurrency {concs} is above {HF_MAX_CONCURRENCY}"
            )
        return chosen
    for c in given:
        _check_positive("hf_concurrency", c)
    outside = sorted(set(given) - set(concs))
    if not given or outside:
        raise ConfigError("hf_concurrency", outside or given, f"one or more of the sweep's concurrencies {concs}")
    return sorted(set(given))


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, value, "must be a positive integer")


def _check_fits(prompt_ids: list[list[int]], output_len: int, max_model_len: int) -> None:
    longest = max(len(p) for p in prompt_ids)
    if longest + output_len > max_model_len:
        raise ConfigError(
            "output_len",
            output_len,
            f"the longest prompt ({longest} tokens) plus output_len must fit max_model_len={max_model_len}",
        )


def _ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    a = np.asarray(values) * 1e3
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def _row(arm: Arm, concurrency: int, temperature: float, rounds: list[Round]) -> dict[str, Any]:
    r = sorted(rounds, key=lambda x: x.output_throughput)[(len(rounds) - 1) // 2]
    d = r.counters  # empty for hf: no drafts, no preemption count
    drafts, draft_tokens = d.get("spec_decode_num_drafts", 0), d.get("spec_decode_num_draft_tokens", 0)
    accepted = d.get("spec_decode_num_accepted_tokens", 0)
    spec = arm.speculates
    acceptance = 1 + accepted / drafts if spec and drafts else None
    request_steps = r.num_output_tokens - accepted
    completed = len(r.e2el_s)
    row: dict[str, Any] = {
        "arm": arm.name,
        "concurrency": concurrency,
        "temperature": temperature,
        "output_throughput": r.output_throughput,
        "rounds_output_throughput": [x.output_throughput for x in rounds],
        "acceptance_length": acceptance,
        "mean_verify_len": draft_tokens / request_steps if spec and request_steps else None,
        "duration": r.elapsed_s,
        "completed": completed,
        "max_in_flight": r.max_in_flight,
        "total_input_tokens": r.num_input_tokens,
        "total_output_tokens": r.num_output_tokens,
        "request_throughput": completed / r.elapsed_s,
        "total_token_throughput": (r.num_input_tokens + r.num_output_tokens) / r.elapsed_s,
    }
    for name, values in (("ttft", r.ttft_s), ("tpot", r.tpot_s), ("e2el", r.e2el_s)):
        row.update({f"{stat}_{name}_ms": v for stat, v in _ms(values).items()})
    row.update(
        {
            "num_preemptions": d.get("num_preemptions"),
            "spec_decode_acceptance_length": acceptance,
            "spec_decode_num_drafts": drafts if spec else None,
            "spec_decode_draft_tokens": draft_tokens if spec else None,
            "spec_decode_accepted_tokens": accepted if spec else None,
            "verify_budget_mean": (
                d["verify_budget_sum"] / d["num_planned_steps"] if arm.adaptive and d["num_planned_steps"] else None
            ),
            "num_steps_without_drafting": d["spec_decode_num_steps_without_drafting"] if arm.adaptive else None,
            "num_steps": d.get("num_steps"),
            # The budget choice and the allocation (kernel and copy), as a share of the row's wall time.
            "plan_time_fraction": d["plan_ms"] / (r.elapsed_s * 1e3) if arm.adaptive else None,
            # tokens/ms of each regime per load level (requests, in powers of two: level L holds 2^(L-1)..2^L - 1)
            "regime_tokens_per_ms": r.regime_rates,
            # the drafting choice's steps per load level over the row: where adaptive drafted
            "regime_steps": r.regime_steps,
            # per kind of step (engine.step_kind): steps, their total and median wall ms, and the slowest
            "step_ms_by_kind": {
                kind: {
                    "steps": len(ms),
                    "total_ms": round(sum(ms), 3),
                    "median_ms": round(statistics.median(ms), 3),
                    "max_ms": round(max(ms), 3),
                }
                for kind, ms in r.step_ms.items()
            },
            # [step in the row, requests running, kind, wall ms] of its first speculative steps (the median round)
            "spec_steps": r.spec_steps,
            # each round's median step wall ms per kind, in round order: the step's own time, beside throughput
            "rounds_step_median_ms": [_step_medians(x) for x in rounds],
            # each round's number of speculative steps (drafted or verified, no prompt chunk), in round order
            "rounds_spec_steps": [sum(len(x.step_ms.get(k, [])) for k in SPEC_KINDS) for x in rounds],
            # Greedy decoding must not change a token: "n/N" of this row's outputs equal no-spec's (temperature 0).
            "identical_to_no_spec": None,
        }
    )
    return row


def _step_medians(r: Round) -> dict[str, float]:
    return {kind: round(statistics.median(ms), 3) for kind, ms in r.step_ms.items() if ms}


# ---- reporting ----------------------------------------------------------------------------------------------------


def _by_row(result: dict[str, Any]) -> dict[tuple[float, int], dict[str, dict[str, Any]]]:
    """(temperature, concurrency) -> arm -> row."""
    table: dict[tuple[float, int], dict[str, dict[str, Any]]] = {}
    for row in result["rows"]:
        table.setdefault((row["temperature"], row["concurrency"]), {})[row["arm"]] = row
    return table


def adaptive_ratio(arms: dict[str, dict[str, Any]]) -> float | None:
    """Adaptive's output throughput over the best of no-spec and the fixed arms; None without both sides."""
    baseline = [r["output_throughput"] for name, r in arms.items() if name == "no-spec" or name.startswith("fixed-")]
    if "adaptive" not in arms or not baseline:
        return None
    return arms["adaptive"]["output_throughput"] / max(baseline)


def paired_adaptive_ratio(arms: dict[str, dict[str, Any]]) -> float | None:
    """The median over rounds of adaptive's throughput over the best baseline arm's in the same round; None without
    both sides or with one round. NOTE: under --interleave a round's rows of one concurrency run back to back, so a
    slow stretch of the host falls on both sides of each ratio; the ratio of medians can pair a slow round of one arm
    with a fast one of another."""
    baseline = [r for name, r in arms.items() if name == "no-spec" or name.startswith("fixed-")]
    if "adaptive" not in arms or not baseline:
        return None
    mine = arms["adaptive"]["rounds_output_throughput"]
    others = [r["rounds_output_throughput"] for r in baseline]
    if len(mine) < 2 or any(len(o) != len(mine) for o in others):
        return None
    return statistics.median(a / max(o[i] for o in others) for i, a in enumerate(mine))


def hf_ratio(arms: dict[str, dict[str, Any]]) -> float | None:
    """No-spec's output throughput over transformers' (the issue's goal: >= 20x at C = 256); None without both."""
    if "no-spec" not in arms or HF not in arms:
        return None
    return arms["no-spec"]["output_throughput"] / arms[HF]["output_throughput"]


def markdown_table(result: dict[str, Any]) -> str:
    arms = list(result["config"]["arms"])
    table = _by_row(result)
    ratios = [
        (head, fn)
        for head, fn in (
            ("adaptive / max(no-spec, best fixed)", adaptive_ratio),
            ("paired by round (median)", paired_adaptive_ratio),
            ("no-spec / hf", hf_ratio),
        )
        if any(fn(a) is not None for a in table.values())
    ]
    head = ["T", "C", *(f"{a} tok/s" for a in arms), *(h for h, _ in ratios)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for (t, c), by_arm in table.items():
        cells = [f"{t:g}", str(c), *(f"{by_arm[a]['output_throughput']:.1f}" if a in by_arm else "-" for a in arms)]
        cells += ["-" if (ratio := fn(by_arm)) is None else f"{ratio:.2f}x" for _, fn in ratios]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_line(result: dict[str, Any]) -> str:
    table = _by_row(result)
    cfg = result["config"]
    shape = (
        f"{len(cfg['arms'])} arms x {len(cfg['concurrencies'])} concurrencies x {len(cfg['temperatures'])} "
        f"temperatures, {cfg['output_len']} tokens per request, {result['dtype']} on {result['machine']['device_name']}"
    )
    # no-spec / hf at each temperature's largest concurrency where both ran
    hf_ratios = {}
    for (t, c), arms in sorted(table.items(), key=lambda kv: kv[0][1]):
        if (ratio := hf_ratio(arms)) is not None:
            hf_ratios[t] = f"{ratio:.2f}x (C={c}, T={t:g})"
    if hf_ratios:
        shape = f"no-spec / hf: {', '.join(hf_ratios.values())}; {shape}"
    ratios = {key: r for key, arms in table.items() if (r := adaptive_ratio(arms)) is not None}
    if ratios:
        (t_lo, c_lo), (t_hi, c_hi) = min(ratios, key=ratios.__getitem__), max(ratios, key=ratios.__getitem__)
        return (
            f"adaptive / max(no-spec, best fixed): median {statistics.median(ratios.values()):.2f}x, "
            f"{ratios[t_lo, c_lo]:.2f}x (C={c_lo}, T={t_lo:g}) to {ratios[t_hi, c_hi]:.2f}x (C={c_hi}, T={t_hi:g}) "
            f"over {len(ratios)} rows; {shape}"
        )
    wins: dict[str, int] = {}
    for arms in table.values():
        best = max(arms.values(), key=lambda r: r["output_throughput"])["arm"]
        wins[best] = wins.get(best, 0) + 1
    return f"fastest arm: {', '.join(f'{a} in {n}/{len(table)} rows' for a, n in wins.items())}; {shape}"


def plot(result: dict[str, Any], path: Path) -> None:
    """Output throughput by concurrency per arm, hf dashed (top), and drafts verified per request-step of the
    speculative arms (bottom), one column of panels per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms, temps = list(result["config"]["arms"]), result["config"]["temperatures"]
    fig, axes = plt.subplots(2, len(temps), figsize=(5.5 * len(temps), 7.5), squeeze=False, sharex=True)
    for j, t in enumerate(temps):
        top, bottom = axes[0][j], axes[1][j]
        for i, arm in enumerate(arms):
            rows = [r for r in result["rows"] if r["arm"] == arm and r["temperature"] == t]
            xs = [r["concurrency"] for r in rows]
            style = "s--" if arm == HF else "o-"
            top.plot(xs, [r["output_throughput"] for r in rows], style, color=f"C{i}", label=arm)
            if arm != HF and parse_arm(arm).speculates:
                bottom.plot(xs, [r["mean_verify_len"] for r in rows], "o-", color=f"C{i}", label=arm)
        top.set_title(f"temperature {t:g}")
        top.set_ylabel("output tokens/s")
        bottom.set_ylabel("drafts verified per request-step")
        bottom.set_xlabel("concurrency (requests in flight)")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(result["config"]["concurrencies"], [str(c) for c in result["config"]["concurrencies"]])
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # the bottom panel is empty without speculative arms
                ax.legend(fontsize=8)
    fig.suptitle(f"{result['config']['model']}, {result['dtype']} on {result['machine']['device_name']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- command line -------------------------------------------------------------------------------------------------

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


def add_parser(
    subparsers: Any, formatter_class: type[argparse.HelpFormatter] = argparse.RawDescriptionHelpFormatter
) -> argparse.ArgumentParser:
    """Register `sweep` on the `bench` subparsers (cli.py passes its own formatter)."""
    p = subparsers.add_parser(
        "sweep",
        help="no-spec, fixed k and adaptive verification (and transformers) by concurrency and temperature, in one run",
        description="Offline sweep: output tokens/s, acceptance length and drafts verified per request-step of each\n"
        "arm at each concurrency and temperature, on a fixed prompt set in a fixed order.",
        epilog=SWEEP_EPILOG,
        formatter_class=formatter_class,
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
    return p


def write_outputs(result: dict[str, Any], json_path: Path | None, plot_path: Path | None, md_path: Path | None) -> None:
    write_json(json_path, result)
    if plot_path is not None:
        plot(result, plot_path)
    if md_path is not None:
        try:
            md_path.write_text(markdown_table(result) + "\n\n" + summary_line(result) + "\n")
        except OSError as e:
            raise ConfigError("output_md", str(md_path), f"cannot be written ({e})") from None


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
