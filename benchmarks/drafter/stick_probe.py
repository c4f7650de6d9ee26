"""Does a load level that drafts on one text leave drafting when the text stops paying for it? One adaptive engine
runs 8 prompts at once (batch 8) round after round: GSM8K with the regime chooser free, then held drafting
(`regime.held`), then MT-bench free. After each round: tokens/s, the steps each level chose, and level 8's learned
rates and step ms.

    python benchmarks/drafter/stick_probe.py OUT.json [DRAFTER] [--first gsm8k:free,draft,draft] \
        [--then mt-bench:free,free,free]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from provenance import provenance

from dspark import LLM, SamplingParams
from dspark.bench.throughput import load_prompts, tokenize

HOLD = {"free": None, "draft": True, "plain": False}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("output")
    ap.add_argument("drafter", nargs="?", default="dspark/assets/smollm2-135m-dspark")
    ap.add_argument("--data", default="../shared/data/deepspec_eval")
    ap.add_argument("--first", default="gsm8k:free,draft,draft", help="SET:HOLD,HOLD,... (free, draft or plain)")
    ap.add_argument("--then", default="mt-bench:free,free,free")
    ap.add_argument("--num-prompts", type=int, default=8)
    args = ap.parse_args()
    llm = LLM(speculative_config={"method": "dspark", "model": args.drafter}, max_num_seqs=args.num_prompts)
    regime = llm.engine.core.planner.regime
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    level = regime.level(args.num_prompts)
    rows = []
    for phase in (args.first, args.then):
        name, holds = phase.split(":")
        ids = tokenize(llm, load_prompts(str(Path(args.data) / f"{name}.jsonl"), args.num_prompts), True)
        for r, hold in enumerate(holds.split(",")):
            regime.held = HOLD[hold]
            start = time.perf_counter()
            outs = llm.generate(ids, params, use_tqdm=False)
            lv = regime.levels.get(level)
            row = {
                "set": name,
                "round": r,
                "hold": hold,
                "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start),
                "chosen": {str(k): dict(v) for k, v in regime.num_chosen.items()},
                "level_rates": regime.rates().get(level),
                "level_ms": {("spec" if k else "plain"): v for k, v in lv.ms.items()} if lv else None,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.output).write_text(json.dumps({**provenance(), "level": level, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
