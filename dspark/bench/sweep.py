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

import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.bench.hf_arm import HFArm, require_continuous_batching
from dspark.bench.prompts import BUILTIN_PROMPTS
from dspark.bench.rounds import SPEC_KINDS, Round, run_row, step_medians
from dspark.bench.throughput import build_hf_model, drain, machine_info, tokenize
from dspark.config import MAX_SPECULATIVE_TOKENS, EngineConfig, SamplingParams, SpeculativeConfig
from dspark.engine.llm_engine import LLMEngine
from dspark.errors import ConfigError
from dspark.llm import LLM
from dspark.utils.jsonl import read_jsonl_prompts

ARMS = ("no-spec", "fixed-1", "fixed-3", "fixed-5", "fixed-7", "adaptive")
CONCURRENCIES = (1, 16, 32, 64, 128, 256, 512, 1024)
TEMPERATURES = (1.0, 0.0)
ADAPTIVE_K = 7  # the adaptive arm's cap on drafts per request and step: the largest default fixed k
MIN_PROMPTS = 16
WARMUP_TOKENS = 4
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
        # The raw round on one line too, so a run cut short by a time limit still has every finished row.
        raw = {"arm": arm, "concurrency": c, "temperature": t, "elapsed_s": round_.elapsed_s}
        raw |= {"output_tokens": round_.num_output_tokens, "counters": round_.counters}
        raw["step_median_ms"] = step_medians(round_)
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
        gc.unfreeze()  # the engine froze the GC heap (engine/core.py); a frozen cycle is never collected
        gc.collect()  # the next arm's engine sizes its KV cache from the memory this one frees
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
        # first of each row rotating by round. A host can run markedly slower for stretches of seconds: whole engines
        # in turn put such a stretch on one arm's rows, rows in turn share it.
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


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


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
        # a decode step's wall ms (engine.step(), prefill steps left out) and device ms (CUDA: its launch's events),
        # medians over the median round
        "step_wall_ms": _median([ms for kind, v in r.step_ms.items() if kind != "prefill" for ms in v]),
        "step_device_ms": _median(r.device_ms),
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
            "rounds_step_median_ms": [step_medians(x) for x in rounds],
            # each round's number of speculative steps (drafted or verified, no prompt chunk), in round order
            "rounds_spec_steps": [sum(len(x.step_ms.get(k, [])) for k in SPEC_KINDS) for x in rounds],
            # Greedy decoding must not change a token: "n/N" of this row's outputs equal no-spec's (temperature 0).
            "identical_to_no_spec": None,
        }
    )
    return row
