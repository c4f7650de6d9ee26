#!/usr/bin/env bash
# Adaptive verification on CPU (SmolLM2-135M-Instruct fp32, n-gram drafting, K = 7):
#  1. the profiled step-cost curves (`dspark profile`);
#  2. a fixed-k trace of GSM8K and MT-bench prompts (temperature 0), for the simulator;
#  3. `dspark simulate` on that trace, under the measured CPU curve and the synthetic B300-like curve.
# Usage: bash benchmarks/cpu_adaptive.sh   (DATA=... to point at the deepspec_eval prompt files)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data/deepspec_eval}
OUT=benchmarks/results
K=7
dspark() { .venv/bin/python -m dspark "$@"; }

dspark profile --dtype float32 --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $K}" \
    --output-json $OUT/cpu-cost-smollm2-ngram-k$K.json --output-plot $OUT/cpu-cost-smollm2-ngram-k$K.png

TRACE=${TRACE:-/tmp/dspark-cpu-trace-k$K.jsonl}
: > "$TRACE.all"
for set in gsm8k mt-bench; do
    dspark bench spec --dtype float32 --dataset-path "$DATA/$set.jsonl" --num-prompts 32 --output-len 128 \
        --batch-size 8 --temperature 0 \
        --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $K, \"enable_adaptive_verification\": false, \"trace_path\": \"$TRACE.$set\"}"
    # request ids restart per engine: prefix them with the set so streams stay apart
    if [ ! -s "$TRACE.all" ]; then head -n 1 "$TRACE.$set" > "$TRACE.all"; fi
    tail -n +2 "$TRACE.$set" | sed "s/\"id\":\"/\"id\":\"$set-/g" >> "$TRACE.all"
done
mv "$TRACE.all" "$TRACE"
gzip -c "$TRACE" > $OUT/cpu-trace-smollm2-ngram-k$K.jsonl.gz

dspark simulate "$TRACE" --cost b300 --cost $OUT/cpu-cost-smollm2-ngram-k$K.json \
    --output-json $OUT/cpu-simulate-smollm2-ngram-k$K.json --output-plot $OUT/cpu-simulate-smollm2-ngram-k$K.png
