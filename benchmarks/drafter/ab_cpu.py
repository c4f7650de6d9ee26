"""Two drafters (or two calibrations of one) against each other and against no speculation, adaptive verification,
greedy: `dspark bench spec`'s rounds with three engines in one process, the arms alternating in every round.

    python benchmarks/drafter/ab_cpu.py DRAFTER_A DRAFTER_B OUT.json [--sets gsm8k mt-bench] [--rounds 3] \
        [--batch-size 1]

Per set: each arm's tokens/s per round, and the medians of the paired ratios B / A, A / none and B / none; after each
round of A and B, their regime chooser's state at the batch's load level (steps chosen so far, learned tokens/ms and
step ms), so that a level drafting at a loss shows why.
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


def paired(rounds: dict[str, list[float]], x: str, y: str) -> float:
    """The median over rounds of arm x's tokens/s over arm y's."""
    return statistics.median(a / b for a, b in zip(rounds[x], rounds[y], strict=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter_a")
    ap.add_argument("drafter_b")
    ap.add_argument("output")
    ap.add_argument("--data", default="../shared/data/deepspec_eval")
    ap.add_argument("--sets", nargs="+", default=["gsm8k", "mt-bench"])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=1, help="requests at once (the engines' max_num_seqs)")
    args = ap.parse_args()
    arms = {
        "none": LLM(),
        "A": LLM(speculative_config={"method": "dspark", "model": args.drafter_a}),
        "B": LLM(speculative_config={"method": "dspark", "model": args.drafter_b}),
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    result: dict[str, object] = {
        **provenance(),
        "batch_size": args.batch_size,
        "sets": {},
    }
    for name in args.sets:
        prompt_ids = tokenize(
            arms["none"], load_prompts(str(Path(args.data) / f"{name}.jsonl"), args.num_prompts), True
        )
        for llm in arms.values():  # warm-up
            llm.engine.add_request(prompt_ids[0], SamplingParams(temperature=0.0, max_tokens=4))
            drain(llm.engine)
        rounds: dict[str, list[float]] = {arm: [] for arm in arms}
        accepted: dict[str, int] = {"A": 0, "B": 0}
        regime: dict[str, list[dict[str, object]]] = {"A": [], "B": []}
        for r in range(args.rounds):
            for arm, llm in arms.items():
                llm.engine.scheduler.max_num_seqs = args.batch_size
                llm.engine.kv.reset_prefix_cache()  # every round starts cold
                done = run_round(llm.engine, prompt_ids, params, f"{name} r{r + 1} {arm}")
                rounds[arm].append(done.output_throughput)
                if arm != "none":
                    accepted[arm] += done.spec["spec_decode_num_accepted_tokens"]
                    chooser = llm.engine.core.planner.regime
                    level = chooser.level(args.batch_size)
                    lv = chooser.levels.get(level)
                    regime[arm].append(
                        {
                            "chosen": dict(chooser.num_chosen.get(level, {})),
                            "tokens_per_ms": chooser.rates().get(level),
                            "ms": {("spec" if k else "plain"): v for k, v in lv.ms.items()} if lv else None,
                        }
                    )

        row = {"tok_s": rounds, "accepted_tokens": accepted, "regime": regime}
        row |= {f"{x}/{y}": paired(rounds, x, y) for x, y in (("B", "A"), ("A", "none"), ("B", "none"))}
        result["sets"][name] = row  # type: ignore[index]
        print(
            name,
            {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "regime"},
            file=sys.stderr,
        )
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
