#!/usr/bin/env bash
# CPU throughput, dspark vs Hugging Face transformers generate (same prompts, weights and run), for the README.
# Usage: bash benchmarks/cpu_throughput.sh   (writes benchmarks/results/cpu-throughput-<dtype>-b<B>.json)
set -euo pipefail
cd "$(dirname "$0")/.."
for dtype in float32 bfloat16; do
  for batch in 16 1; do
    .venv/bin/dspark bench throughput --num-prompts 16 --output-len 64 --batch-size "$batch" --dtype "$dtype" \
      --output-json "benchmarks/results/cpu-throughput-$dtype-b$batch.json"
  done
done
