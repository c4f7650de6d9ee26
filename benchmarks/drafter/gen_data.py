"""One shard of the SmolLM2 drafter's training data: the target's own answers to the prompt pool, at one or more
temperatures, with prompts the target writes itself added to the pool.

Run one process per GPU (--shard i --num-shards n); each answers every n-th prompt of the pool until its time is up
(unfinished answers are dropped) and writes its sequences as JSON lines or as a compact .npz (uint16 token ids), which
`dspark train-drafter` reads as <run>/sequences.jsonl or <run>/sequences.npz once merged (merge_data.py). In the same
engine and within the same time limit, first:
- --magpie N: N user turns the target writes itself (train/magpie.py), filtered and de-duplicated;
- --follow-ups M: M chat prompts (self-written first) answered once, and a second user turn written for each: those
  answers are training data too, and the two-turn prompts join the pool.
The last --heldout chat prompts of the pool (of the self-written ones when the data directory has no prompt source)
are never answered here: they are written (DeepSpec format) for `dspark calibrate-drafter`.
Usage: see benchmarks/drafter/run_gpu.sh and run_scale.sh.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from pathlib import Path

from dspark import LLM
from dspark.errors import ConfigError
from dspark.train.data import Prompt, Sequence, prompt_pool, regenerate, save_sequences
from dspark.train.magpie import follow_up_prompts, magpie_prompts


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True, help="this shard's sequences: .npz (compact) or JSON lines")
    ap.add_argument("--format", choices=("npz", "jsonl"), help="default: from --out's suffix (.npz, else jsonl)")
    ap.add_argument("--heldout-out", help="write the held-out chat prompts here (DeepSpec format)")
    ap.add_argument("--prompts-out", help="write the self-written prompts here (JSON lines of source and messages)")
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--num-shards", type=int, default=1)
    ap.add_argument("--prompts-per-source", type=int, default=4000)
    ap.add_argument("--samples-per-prompt", type=int, default=2, help="answers per prompt at each temperature > 0")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0], help="answer each prompt at each")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--heldout", type=int, default=200)
    ap.add_argument("--time-limit", type=float, default=150.0, help="seconds in all, writing prompts included")
    ap.add_argument("--magpie", type=int, default=0, metavar="N", help="self-written user turns to add")
    ap.add_argument("--magpie-max-tokens", type=int, default=128, help="longest self-written turn (longer: dropped)")
    ap.add_argument("--follow-ups", type=int, default=0, metavar="M", help="two-turn prompts to add")
    ap.add_argument(
        "--prompt-time-limit", type=float, help="seconds for writing prompts, of --time-limit (default: a third)"
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument(
        "--seed-offset",
        type=int,
        default=0,
        help="a later run: other seeds, and the shard's prompts in another order (the ones an earlier run reached "
        "first are not all first again)",
    )
    args = ap.parse_args()
    suffix_format = "npz" if args.out.endswith(".npz") else "jsonl"
    if args.format is not None and args.format != suffix_format:
        ap.error(f"--out {args.out} does not end in .npz as --format npz needs (or ends in it for jsonl)")
    if args.magpie < 0 or args.follow_ups < 0 or not args.temperatures or min(args.temperatures) < 0:
        ap.error("--magpie and --follow-ups must be >= 0, --temperatures each >= 0")
    return args


def main() -> None:
    args = _args()
    began = time.monotonic()
    try:
        pool = prompt_pool(Path(args.data_dir), args.prompts_per_source, seed=0)
    except ConfigError:
        if not args.magpie:
            raise
        print(f"{args.data_dir} holds no prompt source: self-written prompts only", flush=True)
        pool = []
    chat = [i for i, p in enumerate(pool) if p.chat]
    heldout = set(chat[-args.heldout :]) if args.heldout else set()
    mine = [p for i, p in enumerate(pool) if i not in heldout][args.shard :: args.num_shards]
    llm = LLM(
        model=args.model,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=16384,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=0.85,
    )
    # The prompt-writing shares count from here: the engine's start (graph capture, cost profiling) took longer than
    # the first share on the H200, and not one self-written prompt came back when they counted from the start.
    ready = time.monotonic()
    seed = (args.seed_offset * 100 + args.shard) * 10**9
    prompt_s = args.prompt_time_limit if args.prompt_time_limit is not None else args.time_limit / 3
    # Writing prompts, then answering first turns, then writing follow-ups: each a share of prompt_s at most.
    shares = (1 / 3, 2 / 3, 1.0) if args.follow_ups else (1.0, 1.0, 1.0)
    written: list[Prompt] = []
    heldout_texts = [pool[i].text for i in sorted(heldout)]
    if args.magpie:
        deadline = ready + shares[0] * prompt_s
        written = magpie_prompts(llm, args.magpie, seed, max_tokens=args.magpie_max_tokens, deadline=deadline)
        print(
            f"shard {args.shard}: {len(written)} self-written prompts of {args.magpie} asked, "
            f"{time.monotonic() - ready:.0f} s (the engine took {ready - began:.0f} s to start)",
            flush=True,
        )
        if not heldout:  # no pool to hold prompts out of: hold out self-written ones (at most half)
            keep = len(written) - min(args.heldout, len(written) // 2)
            heldout_texts, written = [p.text for p in written[keep:]], written[:keep]
    if args.heldout_out:
        Path(args.heldout_out).write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in heldout_texts))

    first_turns: list[Sequence] = []
    two_turn: list[Prompt] = []
    if args.follow_ups:
        firsts = [p for p in written + mine if p.chat and not p.history][: args.follow_ups]
        t = args.temperatures[0]
        first_turns = regenerate(llm, firsts, 1, args.max_tokens, t, seed, deadline=ready + shares[1] * prompt_s)
        two_turn = follow_up_prompts(
            llm, first_turns, seed, max_tokens=args.magpie_max_tokens, deadline=ready + shares[2] * prompt_s
        )
        print(f"shard {args.shard}: {len(two_turn)} two-turn prompts of {len(first_turns)} answered", flush=True)
    if args.prompts_out:
        lines = [json.dumps({"source": p.source, "messages": p.messages()}) + "\n" for p in written + two_turn]
        Path(args.prompts_out).write_text("".join(lines))

    # One order for all, shuffled: a deadline then cuts every kind of prompt alike.
    asked = mine + written + two_turn
    random.Random(seed).shuffle(asked)
    answers = regenerate(
        llm,
        asked,
        args.samples_per_prompt,
        args.max_tokens,
        args.temperatures,
        seed=seed + 10**8,  # apart from the first turns' seeds
        deadline=began + args.time_limit,
        progress=True,
    )
    sequences = first_turns + answers
    save_sequences(Path(args.out), sequences)
    per_prompt = sum(args.samples_per_prompt if t > 0 else 1 for t in args.temperatures)
    tokens = sum(len(s.tokens) - s.num_prompt_tokens for s in sequences)
    sources = Counter(s.prompt.source for s in answers if s.prompt is not None)
    temps = Counter(s.temperature for s in sequences)
    print(
        f"shard {args.shard}: {len(sequences)} answers ({len(first_turns)} to first turns, then {len(answers)} of "
        f"{len(asked) * per_prompt} asked; by source {dict(sources)}; by temperature {dict(temps)}), "
        f"{tokens} answer tokens, {time.monotonic() - began:.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
