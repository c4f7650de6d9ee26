"""What each regime is worth on this machine, beside what adaptive verification chose: five engines in one process, the
arms alternating in every round: no speculation, the drafter held plain (never drafting, its context kept), held
drafting (every step, the budget still the planner's), and adaptive (two ways). Greedy, all prompts at once, EOS
ignored.

    python benchmarks/drafter/held_regimes.py OUT.json [--drafter D] [--sets gsm8k mt-bench] [--rounds 4] \
        [--batch-size B]

Two adaptive arms: the regime chooser as shipped (drafting's tokens per step from the drafts' expected acceptance)
and adaptive-realised (from the realised tokens alone, and no drafting bursts for new requests). The results in
benchmarks/results/drafter/regime-expectations-2026-12-03/ came before those bursts existed: there the two arms
differ by expected acceptance alone.

Per set: each arm's tokens/s and steps per round, the medians of paired ratios to no speculation, and the adaptive
engine's learned tokens/ms per load level at the end (what its regime chooser believed).
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

HELD = {"plain": False, "drafting": True, "adaptive": None, "adaptive-realised": None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("output")
    ap.add_argument("--drafter", default="dspark/assets/smollm2-135m-dspark")
    ap.add_argument("--data", default="../shared/data/deepspec_eval")
    ap.add_argument("--sets", nargs="+", default=["gsm8k", "mt-bench"])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=None, help="requests at once (the engines' max_num_seqs)")
    args = ap.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    result: dict[str, object] = {
        **provenance(),
        "sets": {},
    }
    for name in args.sets:  # fresh engines per set: what each learned on one set does not carry to the next
        arms = {"none": LLM()}
        for arm, held in HELD.items():
            arms[arm] = LLM(speculative_config={"method": "dspark", "model": args.drafter})
            arms[arm].engine.core.planner.regime.held = held
            # the regime chooser without expected acceptance (drafting's tokens from the realised average) and without
            # drafting bursts for new requests; the 1.5x clip on a step's time has no switch
            before = arm == "adaptive-realised"
            arms[arm].engine.core.planner.regime.expectations = not before
            arms[arm].engine.core.planner.regime.new_text = not before
        prompts = tokenize(arms["none"], load_prompts(str(Path(args.data) / f"{name}.jsonl"), args.num_prompts), True)
        for llm in arms.values():  # warm-up
            if args.batch_size is not None:
                llm.engine.scheduler.max_num_seqs = args.batch_size
            llm.engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=4))
            drain(llm.engine)
        tok_s: dict[str, list[float]] = {arm: [] for arm in arms}
        steps: dict[str, list[int]] = {arm: [] for arm in arms}
        plain: dict[str, list[int]] = {arm: [] for arm in arms}  # steps without drafting
        for r in range(args.rounds):
            for arm, llm in arms.items():
                llm.engine.kv.reset_prefix_cache()
                before = llm.engine.get_metrics()
                done = run_round(llm.engine, prompts, params, f"{name} r{r + 1} {arm}")
                after = llm.engine.get_metrics()
                tok_s[arm].append(done.output_throughput)
                steps[arm].append(after["num_steps"] - before["num_steps"])
                key = "spec_decode_num_steps_without_drafting"
                plain[arm].append(after.get(key, 0) - before.get(key, 0))
        regime = arms["adaptive"].engine.core.planner.regime
        row = {
            "tok_s": tok_s,
            "steps": steps,
            "steps_without_drafting": plain,
            "vs_none": {
                arm: statistics.median(a / b for a, b in zip(tok_s[arm], tok_s["none"], strict=True))
                for arm in arms
                if arm != "none"
            },
            "adaptive_regime_tokens_per_ms": regime.rates(),
            "adaptive_chosen": regime.num_chosen,
            "adaptive_expectation_ratio": regime.expectation_ratio(),
            "adaptive_realised_regime_tokens_per_ms": arms["adaptive-realised"].engine.core.planner.regime.rates(),
        }
        result["sets"][name] = row  # type: ignore[index]
        print(name, json.dumps(row["vs_none"]), file=sys.stderr)
        del arms
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
