#!/usr/bin/env bash
# The SmolLM2-135M-Instruct DSpark drafter at scale on ONE H200 (issue 27), in runs of at most 10 minutes on the same
# warm machine (state in $RUNS, default /tmp/runs):
#   PHASE=gen   : the target writes MAGPIE user turns and FOLLOW_UPS two-turn prompts, then answers them and the pool
#                 of $DATA at T = 1 (SPP samples) and T = 0, GEN_S seconds in all, into a new uint16 .npz shard (a
#                 later gen run adds a shard, with other seeds); all shards are merged into $R/main/sequences.npz;
#   PHASE=train : `dspark train-drafter` trains or resumes the main drafter for MAIN_S seconds, bf16, BATCH sequences
#                 of BLOCKS blocks a step, checkpointed (run it again to train on: the schedule spans MAIN_STEPS);
#   PHASE=finish: calibrate (STS with shift on held-out prompts, a fit at each of CAL_TEMPS, default "1"), then
#                 `dspark eval-drafter` at T = 0 and T = 1 on the first 80 prompts of gsm8k, humaneval, mbpp and
#                 mt-bench of $DATA/deepspec_eval (those present).
# PHASE may name several, run in that order in one command: PHASE="gen train finish" on a fresh machine. INIT=DIR
# fine-tunes that drafter (e.g. dspark/assets/smollm2-135m-dspark) instead of starting from random weights, GROW=N
# with it adds N identity layers on top (train-drafter --grow-layers); LR sets the peak learning rate, PPS the
# prompts per pool source, PROMPT_S gen's seconds for writing prompts. INT8=1 ships the drafter with int8 weights
# (export.py --int8: a 4-layer drafter stays under the repository's 24 MB) instead of bf16.
# Each phase brings back under $OUT (8 files, 64 MiB at most): drafter-results.tar.gz.part-* (results JSON/MD/PNG,
# logs, the held-out and self-written prompts), after train and finish the drafter as it ships (bf16,
# ship.tar.gz.part-*), after gen the training data (sequences.npz.part-*, uint16) while under DATA_MAX_MB.
# A fresh machine can take the data back: RESTORE=DIR (carried; holding sequences.npz.part-*, and heldout.jsonl from
# the results tarball for PHASE=finish).
# Usage there: source .device/setup.sh && PHASE=gen bash benchmarks/drafter/run_scale.sh   (then train, finish)
# On CPU at toy scale (a dry run): PYTHON=.venv/bin/python DEVICE=cpu TOY=1 PHASE=gen bash \
#   benchmarks/drafter/run_scale.sh
#   then PHASE=train, then PHASE=finish (DATA=../shared/data for the full prompt pool)
set -uo pipefail
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
DATA=${DATA:-.device/data}
R=${RUNS:-/tmp/runs}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python}  # here: PYTHON=.venv/bin/python
PHASE=${PHASE:-gen}
has() { [[ " $PHASE " == *" $1 "* ]]; }
mkdir -p "$OUT" "$R/shards" "$R/main"
if [ "$DEVICE" = cuda ]; then DT=bfloat16; else DT=float32; fi
ENGINE=(--device "$DEVICE" --dtype "$DT")
if [ -n "${TOY:-}" ]; then
  GEN=(--prompts-per-source 2 --samples-per-prompt 1 --max-tokens 16 --heldout 2 --max-num-seqs 16
    --magpie-max-tokens 48)
  MAGPIE=${MAGPIE:-4}; FOLLOW_UPS=${FOLLOW_UPS:-2}; GEN_S=${GEN_S:-240}
  BATCH=${BATCH:-2}; BLOCKS=${BLOCKS:-4}; CKPT=${CKPT:-2}; MAIN_STEPS=${MAIN_STEPS:-4}; MAIN_S=${MAIN_S:-120}
  EVAL=(--num-prompts 2 --max-tokens 16); CAL=(--num-prompts 2 --max-tokens 16)
else
  GEN=(--prompts-per-source "${PPS:-8000}" --samples-per-prompt "${SPP:-2}" --max-tokens 256 --heldout 200
    --max-num-seqs 1024 --magpie-max-tokens 128)
  MAGPIE=${MAGPIE:-30000}; FOLLOW_UPS=${FOLLOW_UPS:-10000}; GEN_S=${GEN_S:-420}
  # One H200 trained 8.5 steps/s at these sizes (benchmarks/results/drafter/scale-2026-12-02): 3,400 steps anneal
  # within one 420 s run.
  BATCH=${BATCH:-64}; BLOCKS=${BLOCKS:-32}; CKPT=${CKPT:-250}; MAIN_STEPS=${MAIN_STEPS:-3400}; MAIN_S=${MAIN_S:-420}
  EVAL=(--num-prompts 80 --max-tokens 256); CAL=(--num-prompts "${CAL_PROMPTS:-200}" --max-tokens 256)
fi
CAL_S=${CAL_S:-120}; EVAL_S=${EVAL_S:-170}; DATA_MAX_MB=${DATA_MAX_MB:-44}  # 3 parts: room left for the results
DRAFTER=(--num-layers "${LAYERS:-2}" --markov-rank "${RANK:-32}" --draft-block-size "${K:-7}")
EVAL_SETS=()
for s in gsm8k humaneval mbpp mt-bench; do
  f="$DATA/deepspec_eval/$s.jsonl"
  if [ -e "$f" ]; then EVAL_SETS+=(--dataset "$f"); else echo "note: $f is missing: not evaluated"; fi
done
quiet() { tr "\r" "\n" | grep -Ev "(it/s|s/it|req/s|s/req)[],]|^\s*$"; }  # no progress bars in the logs
ship() {  # the main drafter as it ships (bf16; int8 with INT8=1) to $OUT (a run cut short still brings it back)
  [ -e "$R/main/drafter/config.json" ] || return 0
  "$PY" benchmarks/drafter/export.py "$R/main/drafter" "$R/ship" ${INT8:+--int8} && rm -f "$OUT"/ship.tar.gz.part-* &&
    tar czf - -C "$R" ship | split -b 15m -d - "$OUT/ship.tar.gz.part-"
}
bring_back() {  # results and logs (and, after gen, the data while small enough) under $OUT
  rm -f "$OUT"/drafter-results.tar.gz.part-* "$OUT"/sequences.npz.part-*
  tar czf "$R/drafter-results.tar.gz" -C "$R" $(cd "$R" && ls -d *.json *.md *.png *.log *.jsonl main/*.json \
    2>/dev/null)
  split -b 15m -d "$R/drafter-results.tar.gz" "$OUT/drafter-results.tar.gz.part-"
  if has gen && [ -e "$R/main/sequences.npz" ]; then
    local mb=$(( $(stat -c %s "$R/main/sequences.npz") / 1048576 ))
    if [ "$mb" -lt "$DATA_MAX_MB" ]; then split -b 15m -d "$R/main/sequences.npz" "$OUT/sequences.npz.part-"
    else echo "note: sequences.npz is $mb MB (DATA_MAX_MB=$DATA_MAX_MB): not brought back"; fi
  fi
  if has train || has finish; then ship; fi
  ls -la "$OUT"
}

if [ -n "${RESTORE:-}" ] && [ ! -e "$R/main/sequences.npz" ]; then
  cat "$RESTORE"/sequences.npz.part-* > "$R/shards/gen-restored.npz" &&
    "$PY" benchmarks/drafter/merge_data.py "$R/main/sequences.npz" "$R/shards/gen-restored.npz" || exit 1
  [ -e "$RESTORE/heldout.jsonl" ] && cp "$RESTORE/heldout.jsonl" "$R/"
fi

if has gen; then
  [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  n=$(ls "$R"/shards/gen-*.npz 2>/dev/null | wc -l)  # this run's shard; its seeds: SEED_OFFSET (default n)
  held=(); [ -e "$R/heldout.jsonl" ] || held=(--heldout-out "$R/heldout.jsonl")  # the first run's, kept
  timeout $((GEN_S + 120)) "$PY" benchmarks/drafter/gen_data.py --data-dir "$DATA" --out "$R/shards/gen-$n.npz" \
    --format npz --device "$DEVICE" --time-limit "$GEN_S" --magpie "$MAGPIE" --follow-ups "$FOLLOW_UPS" \
    --temperatures 1.0 0.0 ${PROMPT_S:+--prompt-time-limit "$PROMPT_S"} --seed-offset "${SEED_OFFSET:-$n}" --prompts-out "$R/prompts-$n.jsonl" "${held[@]}" \
    "${GEN[@]}" 2>&1 | quiet | tee "$R/gen-$n.log" | tail -n 8
  [ -e "$R/shards/gen-$n.npz" ] || { echo "gen: no shard written"; bring_back; exit 1; }
  "$PY" benchmarks/drafter/merge_data.py "$R/main/sequences.npz" "$R"/shards/gen-*.npz
  if has train || has finish; then bring_back > /dev/null; fi  # a later phase cut short keeps this one's files
fi

if has train; then
  [ -e "$R/main/sequences.npz" ] || { echo "train: no $R/main/sequences.npz: run PHASE=gen (or RESTORE)"; exit 1; }
  INIT_ARGS=(); [ -n "${INIT:-}" ] && INIT_ARGS=(--init-from "$INIT" --grow-layers "${GROW:-0}")
  timeout $((MAIN_S + 150)) "$PY" -m dspark train-drafter --data-dir "$DATA" --output-dir "$R/main" "${DRAFTER[@]}" \
    --steps "$MAIN_STEPS" --time-limit "$MAIN_S" --batch-size "$BATCH" --blocks-per-sequence "$BLOCKS" \
    --checkpoint-every "$CKPT" ${LR:+--lr "$LR"} "${INIT_ARGS[@]}" "${ENGINE[@]}" --gpu-memory-utilization 0.2 2>&1 | quiet | tee -a "$R/train.log" \
    | tail -n 6
  if has finish; then bring_back > /dev/null; fi
fi

if has finish; then
  D="$R/main/drafter"
  [ -e "$D/config.json" ] || { echo "finish: no drafter in $D: run PHASE=train first"; exit 1; }
  EV=("${ENGINE[@]}" --gpu-memory-utilization 0.5)
  timeout "$CAL_S" "$PY" -m dspark calibrate-drafter "$D" --dataset "$R/heldout.jsonl" --temperature ${CAL_TEMPS:-1} \
    "${CAL[@]}" "${EV[@]}" 2>&1 | quiet | tee "$R/calibrate.log" | tail -n 4
  for t in 0 1; do
    plot=(); [ "$t" = 1 ] && plot=(--output-plot "$R/reliability-t1.png")
    timeout "$EVAL_S" "$PY" -m dspark eval-drafter "$D" "${EVAL_SETS[@]}" --temperature "$t.0" "${EVAL[@]}" \
      "${EV[@]}" --output-json "$R/eval-t$t.json" --output-md "$R/eval-t$t.md" "${plot[@]}" 2>&1 | quiet \
      | tee "$R/eval-t$t.log" | tail -n 12
    [ "$t" = 0 ] && bring_back > /dev/null
  done
fi

bring_back
