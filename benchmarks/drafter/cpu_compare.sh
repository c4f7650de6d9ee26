#!/usr/bin/env bash
# On CPU (fp32 target): compare drafter checkpoints on the same prompts at fixed k = 7, temperatures 1 and 0.
# Usage: bash benchmarks/drafter/cpu_compare.sh OUT_DIR NAME=DRAFTER_DIR [NAME=DRAFTER_DIR ...]
# (NUM_PROMPTS, MAX_TOKENS and DATA override the defaults below.)
set -euo pipefail
out=$1; shift
DATA=${DATA:-../shared/data/deepspec_eval}
mkdir -p "$out"
for arm in "$@"; do
  name=${arm%%=*}; dir=${arm#*=}
  python -m dspark eval-drafter "$dir" --device cpu --dtype float32 \
    --dataset "$DATA/gsm8k.jsonl" --dataset "$DATA/humaneval.jsonl" --dataset "$DATA/mbpp.jsonl" \
    --dataset "$DATA/mt-bench.jsonl" --num-prompts "${NUM_PROMPTS:-32}" --max-tokens "${MAX_TOKENS:-192}" \
    --temperature 1.0 0.0 --output-json "$out/$name.json" --output-md "$out/$name.md" 2>&1 |
    tr '\r' '\n' | grep -v "it/s\|s/it" | tail -n 14
done
