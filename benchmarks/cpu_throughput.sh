#!/usr/bin/env bash
# CPU throughput, dspark vs Hugging Face transformers generate (same prompts, weights and run), for the README:
# 3 rounds with the arms alternating, medians reported. Batch 1 uses 8 prompts to keep the run short.
# Usage: bash benchmarks/cpu_throughput.sh   (writes benchmarks/results/cpu-throughput-<dtype>-b<B>.json)
set -euo pipefail
cd "$(dirname "$0")/.."
for dtype in float32 bfloat16; do
  for batch in 16 1; do
    prompts=$(( batch == 1 ? 8 : 16 ))
    .venv/bin/dspark bench throughput --num-prompts "$prompts" --output-len 64 --batch-size "$batch" \
      --dtype "$dtype" --repeats 3 --output-json "benchmarks/results/cpu-throughput-$dtype-b$batch.json"
  done
done
