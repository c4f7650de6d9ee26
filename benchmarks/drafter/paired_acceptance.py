"""Two drafters on the same text: their expected acceptance at temperature 1, 1 - 0.5 ||p_draft - p_target||_1 averaged
over block positions, on the same target answers and the same anchors (the training loss's estimate, teacher-forced).

eval-drafter at T = 1 lets each drafter's drafts steer the sampled answer, so two nearly equal drafters read different
texts and their tau differs by the texts' spread (a few %). Here the text is fixed, so the difference is the drafters'
alone, with a standard error from the paired batches.

    python benchmarks/drafter/paired_acceptance.py DRAFTER_A DRAFTER_B OUT.json [--sets mt-bench:48 gsm8k:24 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from provenance import provenance

from dspark import LLM, SamplingParams
from dspark.bench.throughput import load_prompts, tokenize
from dspark.models.loader import load_model
from dspark.models.registry import DEFAULT_MODEL, resolve_model
from dspark.speculative.drafters.dspark.checkpoint import load_drafter
from dspark.train.trainer import batch_loss, pad_batch

CPU = torch.device("cpu")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter_a")
    ap.add_argument("drafter_b")
    ap.add_argument("output")
    ap.add_argument("--data", default="../shared/data/deepspec_eval")
    ap.add_argument("--sets", nargs="+", default=["mt-bench:48", "gsm8k:24", "humaneval:24"], help="SET:PROMPTS")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--blocks", type=int, default=24, help="anchors per answer")
    ap.add_argument("--batch", type=int, default=4, help="answers per pair of measurements")
    args = ap.parse_args()

    llm = LLM()  # the default model's answers at T = 1, seeded
    answers: dict[str, list[tuple[list[int], int]]] = {}
    for item in args.sets:
        name, num = item.split(":")
        ids = tokenize(llm, load_prompts(str(Path(args.data) / f"{name}.jsonl"), int(num)), True)
        outs = llm.generate(ids, SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=7))
        answers[name] = [(list(i) + list(o.outputs[0].token_ids), len(i)) for i, o in zip(ids, outs, strict=True)]
    del llm
    # An fp32 target without the engine's packed CPU weights: what training's forward takes.
    target = load_model(resolve_model(DEFAULT_MODEL), torch.float32, CPU)
    for p in target.parameters():
        p.requires_grad_(False)
    drafters = {
        "A": load_drafter(args.drafter_a, target.config, torch.float32, CPU),
        "B": load_drafter(args.drafter_b, target.config, torch.float32, CPU),
    }
    result: dict[str, object] = {**provenance(), "drafter_a": args.drafter_a, "drafter_b": args.drafter_b, "sets": {}}
    with torch.no_grad():
        for name, rows in answers.items():
            acc: dict[str, list[float]] = {"A": [], "B": []}
            for i in range(0, len(rows), args.batch):
                tokens, mask = pad_batch(rows[i : i + args.batch], CPU)
                for arm, drafter in drafters.items():
                    losses = batch_loss(drafter, target, tokens, mask, args.blocks, torch.Generator().manual_seed(i))
                    assert losses is not None
                    acc[arm].append(losses.acceptance)
            diffs = [b - a for a, b in zip(acc["A"], acc["B"], strict=True)]
            row = {
                "A": statistics.fmean(acc["A"]),
                "B": statistics.fmean(acc["B"]),
                "B_minus_A": statistics.fmean(diffs),
                "standard_error": statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None,
                "batches": len(diffs),
            }
            result["sets"][name] = row  # type: ignore[index]
            print(name, json.dumps(row), flush=True)
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
