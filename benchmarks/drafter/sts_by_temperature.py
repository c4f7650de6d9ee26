"""Survival ECE of a drafter's calibration, fit by fit: each row of `dspark eval-drafter` re-scored from its own trace
with the head's raw confidences, with the drafter's fit at temperature 1 serving every request (what a drafter stored
before fits per temperature), and with the drafter's whole table (each request at its own temperature).

    python benchmarks/drafter/sts_by_temperature.py DRAFTER_DIR OUT.json [--num-prompts 80] [--temperature 0] \
        [--dtype bfloat16] [--max-tokens 256]

The rows' drafts are the same in all three: only the scaling of the recorded confidences differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dspark.speculative.calibration import StsTable
from dspark.speculative.trace import load_trace
from dspark.train.calibrate import calibrated_survival, expected_calibration_error, raw_logits, survival_outcomes
from dspark.train.evaluate import drafter_config, evaluate_drafter
from dspark.utils.jsonl import read_jsonl_prompts

SETS = ("gsm8k", "humaneval", "mbpp", "mt-bench")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter_dir")
    ap.add_argument("output")
    ap.add_argument("--data", default="../shared/data/deepspec_eval")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    datasets = {name: read_jsonl_prompts(Path(args.data) / f"{name}.jsonl")[: args.num_prompts] for name in SETS}
    trace_path = Path(args.output).with_suffix(".trace.jsonl")
    start = time.time()
    result = evaluate_drafter(
        {"dtype": args.dtype},
        args.drafter_dir,
        datasets,
        temperatures=args.temperature,
        max_tokens=args.max_tokens,
        trace_path=trace_path,
        progress=False,
    )
    trace = load_trace(trace_path)
    table = drafter_config(args.drafter_dir).sts_table
    at_1 = table.entries[-1] if table.sampling_temperatures[-1] == 1.0 else None
    k = trace.K
    ids = iter(trace.streams)  # request ids in submission order: the rows' prompts, in order
    rescored = []
    for row in result["rows"]:
        row_ids = [next(ids) for _ in range(row["num_prompts"])]
        blocks = [b for rid in row_ids for b in trace.streams[rid] if b.num_drafts == k]
        z = raw_logits(blocks, table, row["temperature"])
        survived = survival_outcomes(torch.tensor([b.accepted for b in blocks]), k)
        scalings = {"raw": StsTable.single(k, None, None), "table": table}
        if at_1 is not None:
            scalings["t1_fit_for_all"] = StsTable([at_1])
        ece = {}
        for name, scaling in scalings.items():
            inv, bias = scaling.at(np.full(len(blocks), row["temperature"]))
            p = calibrated_survival(z, (1 / inv[0]).tolist(), bias[0].tolist())
            ece[name] = expected_calibration_error(p, survived)
        assert row["ece_after"] is None or abs(ece["table"] - row["ece_after"]) < 1e-9, (ece, row["ece_after"])
        rescored.append({"dataset": row["dataset"], "temperature": row["temperature"], "tau": row["tau"], **ece})
    out = {
        "command": " ".join(sys.argv),
        "wall_s": round(time.time() - start, 1),
        "rows": rescored,
        "table": table.to_json(),
        "eval": result,
    }
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    trace_path.unlink()
    for r in rescored:
        print(r)


if __name__ == "__main__":
    main()
