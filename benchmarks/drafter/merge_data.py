"""Concatenate sequence shards (gen_data.py's, JSON lines or .npz, in any mix) into one file that
`dspark train-drafter` reads as <run>/sequences.npz (or .jsonl).
Usage: python benchmarks/drafter/merge_data.py OUT IN [IN ...]"""

from __future__ import annotations

import argparse
from pathlib import Path

from dspark.train.data import merge_sequences


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the merged file: .npz (uint16 token ids) or JSON lines")
    ap.add_argument("inputs", nargs="+", help="shards, in order")
    args = ap.parse_args()
    count = merge_sequences([Path(p) for p in args.inputs], Path(args.out))
    print(f"{args.out}: {count} sequences from {len(args.inputs)} files", flush=True)


if __name__ == "__main__":
    main()
