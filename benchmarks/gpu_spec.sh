#!/usr/bin/env bash
# On the H200 (see ../shared/device/README.md): the GPU tests, then n-gram speculation against none on GSM8K and
# MT-bench prompts at batch 1, 16 and 64 (bf16, eager torch path, greedy).
# Usage there: source .device/setup.sh && bash benchmarks/gpu_spec.sh   (JSON under $OUT)
set -uo pipefail
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -n "${SKIP_TESTS:-}" ] || python -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -15
for set in gsm8k mt-bench; do
  python -m dspark bench spec --device cuda --dtype bfloat16 --dataset-path "${DATA:-.device/data}/$set.jsonl" --num-prompts 16 \
    --output-len 128 --batch-size 1 --batch-size 16 --batch-size 64 \
    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' \
    --output-json "${OUT:-/tmp}/gpu-spec-ngram-$set.json" 2>&1 | grep -v "req/s]$" | tail -6
done
