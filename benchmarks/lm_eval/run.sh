#!/usr/bin/env bash
# lm-evaluation-harness against `dspark serve`, as a user would run it against vLLM: `lm_eval --model local-completions`
# on the default model, one loglikelihood task (GSM8K's reference answer scored after its question: echo + logprobs)
# and one generation task (GSM8K answered greedily), from the local data files (../shared/data), no download.
#   LM_EVAL=/path/to/venv/bin/lm_eval bash benchmarks/lm_eval/run.sh      # lm-eval==0.4.13 in its own environment
# Writes lm-eval's results JSON (and the samples) under $OUT (default: benchmarks/results/lm_eval).
set -euo pipefail
DATA=$(realpath "${DATA:-../shared/data}")
OUT=${OUT:-benchmarks/results/lm_eval}
LIMIT=${LIMIT:-100}  # documents per task
LM_EVAL=${LM_EVAL:-lm_eval}
PORT=${PORT:-8431}
PYTHON=${PYTHON:-python}
work=$(mktemp -d)
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; rm -rf "$work"' EXIT
for task in benchmarks/lm_eval/*.yaml; do  # lm-eval's YAML has no variables: the data path is written in
  sed "s#\${DSPARK_DATA}#$DATA#" "$task" > "$work/$(basename "$task")"
done
# The tokenizer lm-eval counts the context with: the served model's own, saved as a Hugging Face directory.
"$PYTHON" -c "
from dspark.config import EngineConfig
from dspark.models.registry import resolve_model
from dspark.models.tokenizer import load_tokenizer
load_tokenizer(resolve_model(EngineConfig().model)).save_pretrained('$work/tokenizer')"
"$PYTHON" -m dspark serve --port "$PORT" --log-level warning &
server=$!
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
HF_DATASETS_OFFLINE=1 "$LM_EVAL" --model local-completions \
  --model_args "model=smollm2-135m-instruct,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$work/tokenizer,tokenized_requests=True,num_concurrent=8,max_retries=1" \
  --tasks dspark_gsm8k_answer_ll,dspark_gsm8k_generate --include_path "$work" --limit "$LIMIT" \
  --output_path "$OUT" --log_samples
