"""Adaptive verification across a workload shift: one engine per drafter runs a sequence of sets (by default GSM8K,
where drafting pays, then MT-bench, where at batch 8 on CPU it does not), beside an engine without speculation, the
arms alternating in every round. After each round it reads the regime chooser's learned rates per load level, so a
regime that keeps drafting at a loss shows why.

    python benchmarks/drafter/shift_probe.py OUT.json DRAFTER [DRAFTER ...] [--sets gsm8k mt-bench] [--rounds 2] \
        [--batch-size 8] [--realised-too] [--before-too]

Per set and round: each arm's tokens/s, its share of drafting steps, and its regime's tokens/ms per level.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from provenance import provenance

from dspark.bench.spec import run_round
from dspark.bench.throughput import drain, load_prompts, tokenize
from dspark.config import SamplingParams
from dspark.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("output")
    ap.add_argument("drafters", nargs="+")
    ap.add_argument("--data", default="../shared/data/deepspec_eval")
    ap.add_argument("--sets", nargs="+", default=["gsm8k", "mt-bench"])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8, help="requests at once (the engines' max_num_seqs)")
    ap.add_argument(
        "--realised-too",
        action="store_true",
        help="for each drafter, also an engine whose regime chooser ignores the drafts' expected acceptance "
        "(arm dI-realised: drafting's tokens per step from the realised average alone)",
    )
    ap.add_argument(
        "--before-too",
        action="store_true",
        help="for each drafter, also an engine whose regime chooser ignores expected acceptance and new requests "
        "(arm dI-before: the chooser as it was before either, except the 1.5x clip on a step's time, which has no "
        "switch)",
    )
    args = ap.parse_args()
    arms = {"none": LLM()} | {
        f"d{i}": LLM(speculative_config={"method": "dspark", "model": d}) for i, d in enumerate(args.drafters)
    }
    if args.realised_too:
        for i, d in enumerate(args.drafters):
            llm = arms[f"d{i}-realised"] = LLM(speculative_config={"method": "dspark", "model": d})
            assert llm.engine.core.planner is not None
            llm.engine.core.planner.regime.expectations = False
    if args.before_too:
        for i, d in enumerate(args.drafters):
            llm = arms[f"d{i}-before"] = LLM(speculative_config={"method": "dspark", "model": d})
            assert llm.engine.core.planner is not None
            llm.engine.core.planner.regime.expectations = False
            llm.engine.core.planner.regime.new_text = False
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompts = {
        name: tokenize(arms["none"], load_prompts(str(Path(args.data) / f"{name}.jsonl"), args.num_prompts), True)
        for name in args.sets
    }
    for llm in arms.values():  # warm-up
        llm.engine.scheduler.max_num_seqs = args.batch_size
        llm.engine.add_request(prompts[args.sets[0]][0], SamplingParams(temperature=0.0, max_tokens=4))
        drain(llm.engine)
    rows = []
    for name in args.sets:
        for r in range(args.rounds):
            row: dict[str, object] = {"set": name, "round": r + 1}
            for arm, llm in arms.items():
                llm.engine.kv.reset_prefix_cache()
                before = llm.engine.get_metrics()
                done = run_round(llm.engine, prompts[name], params, f"{name} r{r + 1} {arm}")
                cell: dict[str, object] = {"tok_s": done.output_throughput}
                planner = llm.engine.core.planner
                if planner is not None:
                    after = llm.engine.get_metrics()
                    for key in (
                        "num_steps",
                        "spec_decode_num_steps_without_drafting",
                        "spec_decode_num_accepted_tokens",
                    ):
                        cell[key] = after[key] - before[key]
                    cell["regime_tokens_per_ms"] = planner.regime.rates()
                    cell["regime_ms"] = {lvl: dict(lv.ms) for lvl, lv in planner.regime.levels.items()}
                    cell["regime_tokens"] = {lvl: dict(lv.tokens) for lvl, lv in planner.regime.levels.items()}
                    cell["regime_period"] = {lvl: lv.period for lvl, lv in planner.regime.levels.items()}
                    cell["regime_expected"] = {lvl: lv.expected for lvl, lv in planner.regime.levels.items()}
                    # what the drafting rate uses (regime_tokens is the realised average, which it uses only without
                    # expectations)
                    cell["regime_drafting_tokens"] = {
                        lvl: lv.unaccepted + ratio[0] * lv.expected
                        for lvl, lv in planner.regime.levels.items()
                        if lv.num_expected and (ratio := planner.regime.expectation_ratio()) is not None
                    }
                    cell["regime_ratio"] = planner.regime.expectation_ratio()
                row[arm] = cell
            for arm in arms:
                if arm != "none":
                    row[f"{arm}/none"] = row[arm]["tok_s"] / row["none"]["tok_s"]  # type: ignore[index]
            rows.append(row)
            print(json.dumps(row, default=str), file=sys.stderr)
    summary = {
        name: {
            f"{arm}/none": statistics.median(row[f"{arm}/none"] for row in rows if row["set"] == name)  # type: ignore[misc]
            for arm in arms
            if arm != "none"
        }
        for name in args.sets
    }
    result = provenance()
    Path(args.output).write_text(json.dumps({**result, "summary": summary, "rows": rows}, indent=1) + "\n")
    print(json.dumps(summary), file=sys.stderr)


if __name__ == "__main__":
    main()
