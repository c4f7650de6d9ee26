#!/usr/bin/env bash
# CPU, n-gram (prompt lookup) speculation against none on GSM8K and MT-bench prompts (../shared/data, DeepSpec's
# eval sets: first turn through the chat template), batch 1 and 8, greedy, fp32 (exact: both arms emit identical
# tokens). 2 rounds with the arms alternating; medians. Results: benchmarks/results/README.md.
# Usage: bash benchmarks/cpu_spec_ngram.sh   (writes benchmarks/results/cpu-spec-ngram-<set>.json)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data/deepspec_eval}
for set in ${SETS:-gsm8k mt-bench}; do
  .venv/bin/dspark bench spec --dataset-path "$DATA/$set.jsonl" --num-prompts 12 --output-len 128 \
    --batch-size 1 --batch-size 8 --dtype float32 --repeats 2 \
    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' \
    --output-json "benchmarks/results/cpu-spec-ngram-$set.json"
done
