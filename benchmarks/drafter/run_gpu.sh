#!/usr/bin/env bash
# Train, calibrate and evaluate the shipped SmolLM2-135M-Instruct DSpark drafter, and its ablations, on the H200s
# (../shared/device/README.md), in two runs of at most 10 minutes on the same machine (state in /tmp/runs):
#   PHASE=train : the target answers the prompt pool (one shard per GPU, GEN_S seconds), then GPU 0 trains the main
#                 drafter (time-limited: MAIN_S) while the last GPU trains the ablations one after another (ABL_STEPS
#                 steps of 8 sequences each, at most 60 s each, same data);
#   PHASE=finish: GPU 0 resumes the main drafter (FINISH_S seconds at most), calibrates it (STS on held-out prompts)
#                 and evaluates it at temperature 1; the last GPU evaluates the ablations, then the main drafter at
#                 temperature 0. Everything that matters lands in $OUT/drafter-results.tar.gz (+ parts).
# Usage there: source .device/setup.sh && PHASE=train bash benchmarks/drafter/run_gpu.sh
# On CPU at toy scale (a dry run of the script): DEVICE=cpu TOY=1 PHASE=train bash benchmarks/drafter/run_gpu.sh
set -uo pipefail
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
DATA=${DATA:-.device/data}
R=${RUNS:-/tmp/runs}
DEVICE=${DEVICE:-cuda}
PHASE=${PHASE:-train}
mkdir -p "$OUT" "$R"
if [ "$DEVICE" = cuda ]; then NG=$(nvidia-smi -L | wc -l); DT=bfloat16; else NG=1; DT=float32; fi
LAST=$((NG - 1))
ENGINE="--device $DEVICE --dtype $DT"
if [ -n "${TOY:-}" ]; then
  GEN=(--prompts-per-source 3 --samples-per-prompt 1 --max-tokens 24 --heldout 4 --max-num-seqs 16)
  SCALE=(--batch-size 2 --blocks-per-sequence 4 --checkpoint-every 2); MAIN_STEPS=${MAIN_STEPS:-4}
  ABL_STEPS=${ABL_STEPS:-2}; EVAL=(--num-prompts 2 --max-tokens 16); ABL_EVAL=(--num-prompts 2 --max-tokens 16)
  ABLATIONS=${ABLATIONS:-"l1-r32 l2-r0"}
else
  GEN=(--prompts-per-source 4000 --samples-per-prompt 2 --max-tokens 256 --heldout 200)
  SCALE=(--batch-size 16 --blocks-per-sequence 48 --checkpoint-every 250); MAIN_STEPS=${MAIN_STEPS:-6000}
  ABL_STEPS=${ABL_STEPS:-500}; EVAL=(--num-prompts 80 --max-tokens 256); ABL_EVAL=(--num-prompts 48 --max-tokens 192)
  ABLATIONS=${ABLATIONS:-"l2-r32 l1-r32 l3-r32 l2-r0 l2-r64"}
fi
GEN_S=${GEN_S:-150}; MAIN_S=${MAIN_S:-330}; FINISH_S=${FINISH_S:-240}
EVAL_SETS=()
for s in gsm8k humaneval mbpp mt-bench livecodebench.jsonl.gz aime25; do
  f="$DATA/deepspec_eval/$s"; [[ $f == *.gz ]] || f="$f.jsonl"; [ -e "$f" ] && EVAL_SETS+=(--dataset "$f")
done
on() { if [ "$DEVICE" = cuda ]; then CUDA_VISIBLE_DEVICES=$1 "${@:2}"; else "${@:2}"; fi; }
on_env() { if [ "$DEVICE" = cuda ]; then echo "CUDA_VISIBLE_DEVICES=$1"; else echo "DSPARK_ON_CPU=1"; fi; }
ship_main() {  # the main drafter in bf16, how it ships, straight to $OUT (a run cut short still brings it back)
  [ -e "$R/main/drafter/config.json" ] || return 0
  python benchmarks/drafter/export.py "$R/main/drafter" "$R/ship" && rm -f "$OUT"/ship.tar.gz.part-* &&
    tar czf - -C "$R" ship | split -b 15m -d - "$OUT/ship.tar.gz.part-"
}
quiet() { tr '\r' '\n' | grep -v "it/s]$\|s/it]$\|req/s]$" ; }
train() {  # GPU, run dir, layers, rank, steps, seconds [more flags]
  on "$1" python -m dspark train-drafter --data-dir "$DATA" --output-dir "$2" --num-layers "$3" --markov-rank "$4" \
    --steps "$5" --time-limit "$6" "${SCALE[@]}" "${@:7}" $ENGINE --gpu-memory-utilization 0.25 2>&1 | quiet | tail -n 30
}
answer() {  # the target answers the pool, one shard per GPU, GEN_S seconds; $1: seed offset (a later run: 1)
  [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  for i in $(seq 0 $LAST); do
    local held=(); [ "$i" = 0 ] && held=(--heldout-out "$R/heldout.jsonl")  # one writer of the held-out prompts
    on "$i" python benchmarks/drafter/gen_data.py --data-dir "$DATA" --out "$R/seq-$i.jsonl" --shard "$i" \
      --num-shards "$NG" --time-limit "$GEN_S" --device "$DEVICE" "${held[@]}" "${GEN[@]}" --seed-offset "$1" \
      2>&1 | quiet | tail -n 2 &
  done
  wait
}
ablation_dims() { local a=${1#l}; echo "${a%%-*} ${a#*-r}"; }

if [ "$PHASE" = train ]; then
  answer 0
  mkdir -p "$R/main"
  cat "$R"/seq-*.jsonl > "$R/main/sequences.jsonl"
  echo "sequences: $(wc -l < "$R/main/sequences.jsonl")"
  train 0 "$R/main" 2 32 "$MAIN_STEPS" "$MAIN_S" > "$R/main.log" &
  (
    for a in $ABLATIONS; do
      read -r layers rank <<< "$(ablation_dims "$a")"
      mkdir -p "$R/abl-$a" && ln -sf "$R/main/sequences.jsonl" "$R/abl-$a/sequences.jsonl"
      echo "== ablation $a"; train "$LAST" "$R/abl-$a" "$layers" "$rank" "$ABL_STEPS" 60 --batch-size 8
    done
  ) > "$R/ablations.log" 2>&1 &
  wait
  cat "$R/main.log" "$R/ablations.log"
fi

if [ "$PHASE" = finish ]; then
  D="$R/main/drafter"
  EV="$ENGINE --gpu-memory-utilization 0.4"
  rm -f "$R/main.calibrated"
  (
    train 0 "$R/main" 2 32 "$MAIN_STEPS" "$FINISH_S"
    on 0 python -m dspark calibrate-drafter "$D" --dataset "$R/heldout.jsonl" --temperature 1.0 "${EVAL[@]}" $EV \
      2>&1 | quiet | tail -n 20
    touch "$R/main.calibrated"
    on 0 python -m dspark eval-drafter "$D" "${EVAL_SETS[@]}" --temperature 1.0 "${EVAL[@]}" $EV \
      --output-json "$R/eval-t1.json" --output-plot "$R/reliability-t1.png" --output-md "$R/eval-t1.md" \
      2>&1 | quiet | tail -n 20
  ) > "$R/finish-main.log" 2>&1 &
  (
    for a in $ABLATIONS; do
      echo "== ablation $a"
      on "$LAST" python -m dspark eval-drafter "$R/abl-$a/drafter" "${EVAL_SETS[@]:0:8}" --temperature 1.0 \
        "${ABL_EVAL[@]}" $EV --output-json "$R/abl-$a.json" --output-md "$R/abl-$a.md" 2>&1 | quiet | tail -n 12
    done
    while [ ! -e "$R/main.calibrated" ]; do sleep 2; done  # the main drafter is final (trained and calibrated)
    on "$LAST" python -m dspark eval-drafter "$D" "${EVAL_SETS[@]}" --temperature 0.0 "${EVAL[@]}" $EV \
      --output-json "$R/eval-t0.json" --output-md "$R/eval-t0.md" 2>&1 | quiet | tail -n 12
  ) > "$R/finish-abl.log" 2>&1 &
  wait
  cat "$R/finish-main.log" "$R/finish-abl.log"
fi

if [ "$PHASE" = full ]; then  # one run: more answers (added to PREV's), main + DFlash-style drafters, calibrate, eval
  D="$R/main/drafter"
  EV="$ENGINE --gpu-memory-utilization 0.4"
  answer 1
  mkdir -p "$R/main" "$R/abl-l2-r0-full"
  { [ -n "${PREV:-}" ] && gzip -dc "$PREV"; cat "$R"/seq-*.jsonl; } > "$R/main/sequences.jsonl"
  ln -sf "$R/main/sequences.jsonl" "$R/abl-l2-r0-full/sequences.jsonl"
  echo "sequences: $(wc -l < "$R/main/sequences.jsonl")"
  train 0 "$R/main" 2 32 "$MAIN_STEPS" "$MAIN_S" > "$R/main.log" &
  train "$LAST" "$R/abl-l2-r0-full" 2 0 "$MAIN_STEPS" "$MAIN_S" > "$R/abl-l2-r0-full.log" &
  wait
  cat "$R/main.log" "$R/abl-l2-r0-full.log"
  ship_main
  (
    timeout "${CAL_S:-90}" env $(on_env 0) python -m dspark calibrate-drafter "$D" --dataset "$R/heldout.jsonl" \
      --temperature 1.0 --num-prompts "${CAL_PROMPTS:-96}" --max-tokens 256 $EV 2>&1 | quiet | tail -n 30
    ship_main
    timeout "${EVAL_S:-100}" env $(on_env 0) python -m dspark eval-drafter "$D" "${EVAL_SETS[@]}" --temperature 1.0 \
      "${EVAL[@]}" $EV --output-json "$R/eval-t1.json" --output-plot "$R/reliability-t1.png" \
      --output-md "$R/eval-t1.md" 2>&1 | quiet | tail -n 12
  ) > "$R/finish-main.log" 2>&1 &
  (
    timeout "${ABL_EVAL_S:-60}" env $(on_env "$LAST") python -m dspark eval-drafter "$R/abl-l2-r0-full/drafter" \
      "${EVAL_SETS[@]:0:8}" --temperature 1.0 "${ABL_EVAL[@]}" $EV --output-json "$R/abl-l2-r0-full.json" \
      --output-md "$R/abl-l2-r0-full.md" 2>&1 | quiet | tail -n 12
    timeout "${EVAL_S:-100}" env $(on_env "$LAST") python -m dspark eval-drafter "$D" "${EVAL_SETS[@]}" \
      --temperature 0.0 "${EVAL[@]}" $EV --output-json "$R/eval-t0.json" --output-md "$R/eval-t0.md" 2>&1 \
      | quiet | tail -n 12
  ) > "$R/finish-abl.log" 2>&1 &
  wait
  cat "$R/finish-main.log" "$R/finish-abl.log"
fi

# Bring back what matters (8 files of at most 16 MiB): the main drafter in bf16 (how it ships), results and logs in
# a tarball cut into parts, and the training answers (gzipped).
ship_main
tar czf /tmp/drafter-results.tar.gz -C "$R" $(cd "$R" && ls -d *.json *.md *.png *.log heldout.jsonl \
  */train_config.json 2>/dev/null)
rm -f "$OUT"/drafter-results.tar.gz.part-* "$OUT"/sequences.jsonl.gz.part-*
split -b 15m -d /tmp/drafter-results.tar.gz "$OUT/drafter-results.tar.gz.part-"
gzip -c "$R/main/sequences.jsonl" | split -b 15m -d - "$OUT/sequences.jsonl.gz.part-"
ls -la "$OUT"
