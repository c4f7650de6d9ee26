#!/usr/bin/env bash
# The speculative-step goal on one H200 (docs/architecture.md, worker/spec_pipeline.py): no speculation, adaptive
# DSpark and fixed k = 1, 3, 7, built once each and taking turns row by row (bench sweep --interleave), at
# C = 1, 16, 64, 256, 1024, T = 0 and 1, GOAL_REPEATS (3) rounds, 256 tokens with EOS ignored, the default prompt mix
# (.device/data, made by benchmarks/gpu/data_prepare.sh), 4096 batched tokens a step (five engines share the GPU;
# a step of C requests verifies at most 4096 - C drafts). Each row has its output throughput, acceptance length,
# drafts verified per request-step, and a decode step's median wall and device ms. Run after staging:
#   source .device/setup.sh && bash benchmarks/gpu/goal.sh
# It writes spec-goal.json, spec-goal.md and spec-goal.png under $OUT (default: benchmarks/results/h200).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/h200}
DATA=${DATA:-.device/data}
mkdir -p "$OUT"
arms=$(for a in ${GOAL_ARMS:-no-spec adaptive fixed-1 fixed-3 fixed-7}; do printf -- "--arm %s " "$a"; done)
timeout "${GOAL_S:-570}" python -m dspark bench sweep --device cuda --speculative-config '{"method": "dspark"}' \
  $arms --interleave --concurrency ${GOAL_CONCS:-1 16 64 256 1024} --temperature ${GOAL_TEMPS:-0 1} \
  --repeats "${GOAL_REPEATS:-3}" --output-len 256 --waves 1 --max-num-batched-tokens 4096 \
  --gpu-memory-utilization 0.9 --data-dir "$DATA" --output-json "$OUT/spec-goal.json" --output-md "$OUT/spec-goal.md" \
  --output-plot "$OUT/spec-goal.png" 2>&1 | tr '\r' '\n' | grep -v "it/s\|s/it" > "$OUT/spec-goal.log"
rc=${PIPESTATUS[0]}
tail -5 "$OUT/spec-goal.log"
cat "$OUT/spec-goal.md" 2>/dev/null
exit "$rc"
