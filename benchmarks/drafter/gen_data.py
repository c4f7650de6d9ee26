"""One shard of the SmolLM2 drafter's training data: the target's own sampled answers to the prompt pool.

Run one process per GPU (--shard i --num-shards n); each answers every n-th prompt of the pool (all queued at
once) until its time is up (unfinished answers are dropped), and writes JSON lines that `dspark train-drafter` reads
as <run>/sequences.jsonl once concatenated. The last --heldout chat prompts of the pool are never answered here:
they are written (DeepSpec format) for `dspark calibrate-drafter`. Usage: see benchmarks/drafter/run_gpu.sh.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dspark import LLM
from dspark.train.data import prompt_pool, regenerate, save_sequences


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True, help="sequences JSONL of this shard")
    ap.add_argument("--heldout-out", help="write the held-out chat prompts here (DeepSpec format)")
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--num-shards", type=int, default=1)
    ap.add_argument("--prompts-per-source", type=int, default=4000)
    ap.add_argument("--samples-per-prompt", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--heldout", type=int, default=200)
    ap.add_argument("--time-limit", type=float, default=150.0)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument(
        "--seed-offset",
        type=int,
        default=0,
        help="a later run: other seeds, and the shard's prompts in reverse order (the ones an earlier run reached "
        "first come last)",
    )
    args = ap.parse_args()

    began = time.monotonic()
    pool = prompt_pool(Path(args.data_dir), args.prompts_per_source, seed=0)
    chat = [i for i, p in enumerate(pool) if p.chat]
    heldout = set(chat[-args.heldout :]) if args.heldout else set()
    if args.heldout_out:
        lines = [json.dumps({"turns": [pool[i].text], "source": pool[i].source}) for i in sorted(heldout)]
        Path(args.heldout_out).write_text("\n".join(lines) + "\n")
    mine = [p for i, p in enumerate(pool) if i not in heldout][args.shard :: args.num_shards]
    if args.seed_offset:
        mine.reverse()
    llm = LLM(
        model=args.model,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=16384,
        max_model_len=1024,
        gpu_memory_utilization=0.85,
    )
    sequences = regenerate(
        llm,
        mine,
        args.samples_per_prompt,
        args.max_tokens,
        1.0,
        seed=(args.seed_offset * 100 + args.shard) * 10**9,
        deadline=began + args.time_limit,
        progress=True,
    )
    tokens = sum(len(s.tokens) - s.num_prompt_tokens for s in sequences)
    print(
        f"shard {args.shard}: {len(sequences)} answers of {len(mine) * args.samples_per_prompt} asked, "
        f"{tokens} answer tokens, {time.monotonic() - began:.0f} s",
        flush=True,
    )
    save_sequences(Path(args.out), sequences)


if __name__ == "__main__":
    main()
