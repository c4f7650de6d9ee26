#!/usr/bin/env bash
# The server-at-engine-speed goal on one H200: `dspark serve` (its engine core in its own process) against an offline
# LLMEngine of the same configuration (no speculation, bf16, 0.4 of the GPU memory each), taking turns at
# C = 1, 16, 64, 256 for 3 rounds on GSM8K prompts (completions), 256 tokens with EOS ignored, T = 0
# (benchmarks/serve_goal.py), the server with 4 API servers, the client in 4 processes. Stage with the server's wheels
# (../shared/device/README.md):
#   ../shared/device/stage fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 \
#     pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 anyio==4.16.0 \
#     sniffio==1.3.1 pyzmq==27.3.0 msgspec==0.23.0 typing_extensions==4.16.0 opentelemetry-api==1.45.2 \
#     uvloop==0.23.0 httptools==0.9.0
# then, with .device/data from benchmarks/gpu/data_prepare.sh carried:
#   source .device/setup.sh && bash benchmarks/gpu/serve_goal.sh
# It writes serve-goal.json and serve-goal.log under $OUT (default: benchmarks/results/h200).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # dspark from this tree
OUT=${OUT:-benchmarks/results/h200}
DATA=${DATA:-.device/data}
mkdir -p "$OUT"
timeout "${SERVE_GOAL_S:-570}" python benchmarks/serve_goal.py --device cuda --dtype bfloat16 \
  --dataset-path "$DATA/deepspec_eval/gsm8k.jsonl" --concurrency ${SERVE_CONCS:-1 16 64 256} \
  --rounds "${SERVE_ROUNDS:-3}" --output-len 256 --api-server-count "${SERVE_API_SERVERS:-4}" \
  --client-workers "${SERVE_CLIENT_WORKERS:-4}" --output-json "$OUT/serve-goal.json" 2>&1 |
  tr '\r' '\n' | grep -v "it/s\|s/it" > "$OUT/serve-goal.log"
rc=${PIPESTATUS[0]}
tail -12 "$OUT/serve-goal.log"
exit "$rc"
