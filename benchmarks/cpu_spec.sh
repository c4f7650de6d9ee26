#!/usr/bin/env bash
# CPU speculation at batch 1 against none, default model and dtype: DSpark (the shipped drafter, adaptive verification)
# and n-gram (4 drafts) on GSM8K and MT-bench prompts (../shared/data, DeepSpec's eval sets: first turn through the chat
# template), 8 prompts x 128 tokens, greedy, 3 rounds with the arms alternating; medians of paired ratios.
# Usage: bash benchmarks/cpu_spec.sh   (writes benchmarks/results/cpu/<date>-<commit>/spec-<method>-<set>-b1.json;
# SETS and METHODS choose fewer, e.g. METHODS=dspark after a new drafter)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data/deepspec_eval}
out="benchmarks/results/cpu/$(date -u +%F)-$(git rev-parse --short HEAD)"
mkdir -p "$out"
for set in ${SETS:-gsm8k mt-bench}; do
  for method in ${METHODS:-dspark ngram}; do
    spec='{"method": "dspark"}'
    [ "$method" = ngram ] && spec='{"method": "ngram", "num_speculative_tokens": 4}'
    .venv/bin/dspark bench spec --speculative-config "$spec" --dataset-path "$DATA/$set.jsonl" --num-prompts 8 \
      --output-len 128 --batch-size 1 --repeats 3 --output-json "$out/spec-$method-$set-b1.json"
  done
done
