#!/usr/bin/env bash
# On the H200 (see ../shared/device/README.md): the GPU tests, then dspark vs transformers throughput (eager engine).
# Usage there: source .device/setup.sh && bash benchmarks/gpu_smoke.sh   (JSON under $OUT)
set -uo pipefail
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -15
for batch in 16 64; do
  python -m dspark bench throughput --device cuda --dtype bfloat16 --num-prompts 64 --output-len 64 \
    --batch-size "$batch" --output-json "${OUT:-/tmp}/gpu-throughput-bf16-b$batch.json" 2>&1 | grep -v "it/s]$" | tail -3
done
