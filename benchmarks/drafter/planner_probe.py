"""What adaptive verification did with each of several drafters: one engine per drafter, the same prompts at once
(batch = their number), greedy, and the planner's metrics over the run (drafting steps, verify budget, predicted and
realised accepted tokens, cost-model errors and learned overheads).

    python benchmarks/drafter/planner_probe.py OUT.json DRAFTER [DRAFTER ...] [--set mt-bench] [--num-prompts 8] \
        [--max-num-seqs N]

--max-num-seqs caps the batch (the prompts then queue: --max-num-seqs 1 runs them one at a time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from provenance import provenance

from dspark import LLM, SamplingParams
from dspark.bench.throughput import load_prompts, tokenize


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("output")
    ap.add_argument("drafters", nargs="+")
    ap.add_argument("--data", default="../shared/data/deepspec_eval")
    ap.add_argument("--set", default="mt-bench")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    args = ap.parse_args()
    engine = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    runs = []
    for drafter in args.drafters:
        llm = LLM(speculative_config={"method": "dspark", "model": drafter}, **engine)
        prompts = load_prompts(str(Path(args.data) / f"{args.set}.jsonl"), args.num_prompts)
        ids = tokenize(llm, prompts, True)
        llm.generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
        before = llm.get_metrics()
        start = time.perf_counter()
        outputs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True))
        elapsed = time.perf_counter() - start
        after = llm.get_metrics()
        run = {"drafter": drafter, "output_tok_s": sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed}
        for key, value in after.items():
            if key == "spec_decode_verify_len_hist":  # drafts verified per request-step, over the run
                run[key] = [a - b for a, b in zip(value, before.get(key, [0] * len(value)), strict=True)]
            elif key == "num_steps" or key.startswith("spec_decode"):
                if not isinstance(value, int | float):
                    continue
                # Counters as their change over the run; rates, means and learned values as they ended.
                counter = key.endswith(("_total", "_tokens", "_drafts", "_steps", "explorations")) or key == "num_steps"
                run[key] = value - before.get(key, 0) if counter else value
        runs.append(run)
        print(json.dumps(run), file=sys.stderr)
        del llm
    result = provenance()
    Path(args.output).write_text(json.dumps({**result, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
