#!/usr/bin/env bash
# CPU throughput and prefill, dspark against Hugging Face transformers (same prompts, weights and run): decode at batch
# 1 and 16 (16 prompts x 64 tokens, EOS ignored, greedy) and the first token of a 2,000- and an 8,000-token prompt
# against transformers' forward over it; 3 rounds with the arms alternating, medians of paired ratios.
# Usage: bash benchmarks/cpu_throughput.sh   (writes benchmarks/results/cpu/<date>-<commit>/throughput-<dtype>.json)
set -euo pipefail
cd "$(dirname "$0")/.."
out="benchmarks/results/cpu/$(date -u +%F)-$(git rev-parse --short HEAD)"
mkdir -p "$out"
for dtype in bfloat16 float32; do
  .venv/bin/dspark bench throughput --dtype "$dtype" --num-prompts 16 --output-len 64 --batch-size 1 16 \
    --prefill-len 2000 8000 --repeats 3 --output-json "$out/throughput-$dtype.json"
done
