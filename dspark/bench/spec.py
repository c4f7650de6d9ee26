"""Speculative decoding against no speculation: same engine settings, same prompts, same run.

For each batch size (max_num_seqs) the two arms alternate round by round on the same prompt token ids; each arm's
output throughput is its median round, the speed-up is the median of the per-round ratios. Requests stop at EOS or
`output_len` tokens, so acceptance is measured on real text, not on what a model babbles after EOS; at temperature 0
both arms emit the same tokens (checked and reported), so their token counts match. Acceptance length is vLLM's:
1 + accepted drafts / drafts, over the arm's rounds.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any

from tqdm import tqdm

from dspark.bench.throughput import drain, load_prompts, machine_info, tokenize
from dspark.config import EngineConfig, SamplingParams
from dspark.engine.llm_engine import LLMEngine
from dspark.errors import ConfigError
from dspark.llm import LLM

SPEC_KEYS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


@dataclasses.dataclass
class Round:
    elapsed_s: float
    output_tokens: int
    outputs: list[list[int]]
    spec: dict[str, int]  # spec-decode counter deltas over the round
    accepted_per_pos: list[int]

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.elapsed_s


def run_round(engine: LLMEngine, prompt_ids: list[list[int]], params: SamplingParams, label: str) -> Round:
    before = engine.get_metrics()
    bar = tqdm(total=len(prompt_ids), desc=label, unit="req", file=sys.stderr, leave=False)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompt_ids]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
                bar.update(1)
    elapsed = time.perf_counter() - start
    bar.close()
    after = engine.get_metrics()
    outputs = [final[i].outputs[0].token_ids for i in ids]
    per_pos = [
        a - b
        for a, b in zip(
            after["spec_decode_num_accepted_tokens_per_pos"],
            before["spec_decode_num_accepted_tokens_per_pos"],
            strict=True,
        )
    ]
    return Round(elapsed, sum(len(o) for o in outputs), outputs, {k: after[k] - before[k] for k in SPEC_KEYS}, per_pos)


def run_spec_bench(
    config: EngineConfig,
    *,
    batch_sizes: list[int],
    num_prompts: int,
    output_len: int,
    dataset_path: str | None = None,
    chat: bool = True,
    temperature: float = 0.0,
    repeats: int = 1,
    command: str = "",
) -> dict[str, Any]:
    if config.spec is None:
        raise ConfigError("speculative_config", None, "bench spec compares a speculative config with none: give one")
    for b in batch_sizes:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ConfigError("batch_size", b, "must be a positive integer")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError("repeats", repeats, "must be a positive integer")
    prompts = load_prompts(dataset_path, num_prompts)
    # On a GPU each engine sizes its KV cache from the memory still free, so the first gets half the share and
    # the second, seeing the first's use, the rest.
    half = dataclasses.replace(config, gpu_memory_utilization=config.gpu_memory_utilization / 2)
    spec_llm = LLM(**dataclasses.asdict(half))
    base_llm = LLM(**{**dataclasses.asdict(config), "speculative_config": None})
    prompt_ids = tokenize(spec_llm, prompts, chat)
    params = SamplingParams(temperature=temperature, max_tokens=output_len, seed=0 if temperature > 0 else None)
    warm = dataclasses.replace(params, max_tokens=4)
    for llm in (base_llm, spec_llm):
        llm.engine.add_request(prompt_ids[0], warm)
        drain(llm.engine)

    rows = []
    for batch in batch_sizes:
        base_rounds: list[Round] = []
        spec_rounds: list[Round] = []
        for r in range(repeats):
            for llm, rounds, label in ((base_llm, base_rounds, "no-spec"), (spec_llm, spec_rounds, "spec")):
                engine = llm.engine
                engine.scheduler.max_num_seqs = batch  # the only setting that differs between rows
                engine.kv.reset_prefix_cache()  # every round starts cold
                rounds.append(run_round(engine, prompt_ids, params, f"b{batch} r{r + 1} {label}"))
        rows.append(_row(batch, base_rounds, spec_rounds, temperature))
        print(_row_line(rows[-1]), file=sys.stderr)

    return {
        "command": command,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(spec_llm.engine.device),
        "config": {
            "model": config.model,
            "dtype": str(spec_llm.engine.dtype).removeprefix("torch."),
            "speculative_config": dataclasses.asdict(config.spec),
            "num_speculative_tokens": spec_llm.engine.num_spec_tokens,
            "dataset": dataset_path or "builtin",
            "num_prompts": num_prompts,
            "output_len": output_len,
            "temperature": temperature,
            "chat": chat,
            "total_input_tokens": sum(len(p) for p in prompt_ids),
        },
        "repeats": repeats,
        "rows": rows,
    }


def _median(rounds: list[Round]) -> Round:
    return sorted(rounds, key=lambda r: r.output_throughput)[(len(rounds) - 1) // 2]


def _row(batch: int, base: list[Round], spec: list[Round], temperature: float) -> dict[str, Any]:
    drafts = sum(r.spec["spec_decode_num_drafts"] for r in spec)
    accepted = sum(r.spec["spec_decode_num_accepted_tokens"] for r in spec)
    draft_tokens = sum(r.spec["spec_decode_num_draft_tokens"] for r in spec)
    per_pos = [sum(col) for col in zip(*(r.accepted_per_pos for r in spec), strict=True)]
    same = sum(a == b for a, b in zip(base[0].outputs, spec[0].outputs, strict=True))
    return {
        "batch_size": batch,
        "no_spec_output_throughput": _median(base).output_throughput,
        "spec_output_throughput": _median(spec).output_throughput,
        "speedup": statistics.median(
            s.output_throughput / b.output_throughput for b, s in zip(base, spec, strict=True)
        ),
        "rounds_no_spec": [r.output_throughput for r in base],
        "rounds_spec": [r.output_throughput for r in spec],
        "output_tokens": _median(spec).output_tokens,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "per_position_acceptance_rate": [a / drafts for a in per_pos] if drafts else [],
        # Greedy decoding must not change a single token; sampled runs only share the distribution.
        "identical_outputs": f"{same}/{len(base[0].outputs)}" if temperature == 0 else None,
    }


def _row_line(row: dict[str, Any]) -> str:
    acc = row["acceptance_length"]
    line = (
        f"batch {row['batch_size']}: no-spec {row['no_spec_output_throughput']:.1f} tok/s | spec "
        f"{row['spec_output_throughput']:.1f} tok/s | speed-up {row['speedup']:.2f}x | acceptance length "
    )
    line += f"{acc:.2f}" if acc is not None else "n/a"
    return line + (f" | identical {row['identical_outputs']}" if row["identical_outputs"] else "")


def summary_table(result: dict[str, Any]) -> str:
    lines = [
        "| batch | no-spec tok/s | spec tok/s | speed-up | acceptance length | identical |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        acc = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] is not None else "n/a"
        lines.append(
            f"| {r['batch_size']} | {r['no_spec_output_throughput']:.1f} | {r['spec_output_throughput']:.1f} | "
            f"{r['speedup']:.2f}x | {acc} | {r['identical_outputs'] or '-'} |"
        )
    return "\n".join(lines)
