#!/usr/bin/env bash
# On the H200 (see ../shared/device/README.md), SmolLM2-135M-Instruct bf16, eager torch path, n-gram drafting K = 7:
#  1. the GPU tests (Triton allocate == torch twin, with its time at R = 1024);
#  2. the profiled step-cost curves (`dspark profile`);
#  3. a fixed-k trace of GSM8K + MT-bench prompts at batch 64, and `dspark simulate` on it (H200 curve and B300-like);
#  4. `dspark bench sweep` (if SWEEP=1): no-spec, fixed 1/3/5/7 and adaptive on the real engine.
# Usage there: source .device/setup.sh && bash benchmarks/gpu_adaptive.sh   (results under $OUT)
set -uo pipefail
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
DATA=${DATA:-.device/data}
K=7
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -n "${SKIP_TESTS:-}" ] || python -m pytest -q -s -m gpu tests/ -p no:cacheprovider 2>&1 | tail -15
python -m dspark profile --device cuda --dtype bfloat16 \
    --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $K}" \
    --output-json "$OUT/h200-cost-smollm2-ngram-k$K.json" --output-plot "$OUT/h200-cost-smollm2-ngram-k$K.png" 2>&1 | tail -40
TRACE=/tmp/h200-trace.jsonl
: > $TRACE.all
for set in gsm8k mt-bench; do
  python -m dspark bench spec --device cuda --dtype bfloat16 --dataset-path "$DATA/$set.jsonl" --num-prompts 64 \
    --output-len 256 --batch-size 64 --temperature 0 \
    --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $K, \"enable_adaptive_verification\": false, \"trace_path\": \"$TRACE.$set\"}" \
    2>&1 | grep -v "req/s]$" | tail -4
  if [ ! -s $TRACE.all ]; then head -n 1 $TRACE.$set > $TRACE.all; fi
  tail -n +2 $TRACE.$set | sed "s/\"id\":\"/\"id\":\"$set-/g" >> $TRACE.all
done
mv $TRACE.all $TRACE && gzip -c $TRACE > "$OUT/h200-trace-smollm2-ngram-k$K.jsonl.gz"
python -m dspark simulate $TRACE --cost b300 --cost "$OUT/h200-cost-smollm2-ngram-k$K.json" \
    --output-json "$OUT/h200-simulate-smollm2-ngram-k$K.json" --output-plot "$OUT/h200-simulate-smollm2-ngram-k$K.png" \
    2>&1 | grep -v "it/s]$" | tail -60
if [ -n "${SWEEP:-}" ]; then
  python -m dspark bench sweep --device cuda --dtype bfloat16 --dataset-path "$DATA/gsm8k.jsonl" \
    --dataset-path "$DATA/mt-bench.jsonl" --concurrency ${CONCURRENCY:-1 16 64 256} --output-len 128 --temperature 0 \
    --temperature 1 --speculative-config '{"method": "ngram"}' \
    --output-json "$OUT/h200-sweep-ngram.json" --output-plot "$OUT/h200-sweep-ngram.png" \
    --output-md "$OUT/h200-sweep-ngram.md" 2>&1 | grep -v "it/s]$\|req/s]$" | tail -30
fi
