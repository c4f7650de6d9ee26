#!/usr/bin/env bash
# The real engine on CPU (SmolLM2-135M-Instruct fp32, n-gram drafting): no speculation, fixed k and adaptive
# verification at a few concurrencies, GSM8K + MT-bench prompts, greedy, 64 tokens each.
# Usage: bash benchmarks/cpu_sweep.sh   (DATA=... to point at the deepspec_eval prompt files)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data/deepspec_eval}
OUT=benchmarks/results
.venv/bin/python -m dspark bench sweep --dtype float32 --dataset-path "$DATA/gsm8k.jsonl" \
    --dataset-path "$DATA/mt-bench.jsonl" --arm no-spec --arm fixed-1 --arm fixed-3 --arm fixed-7 --arm adaptive \
    --concurrency 1 4 16 --num-prompts 16 --output-len 64 --temperature 0 --speculative-config '{"method": "ngram"}' \
    --output-json $OUT/cpu-sweep-ngram.json --output-plot $OUT/cpu-sweep-ngram.png --output-md $OUT/cpu-sweep-ngram.md
