#!/usr/bin/env bash
# The GPU path on the H200s, in runs of at most 10 minutes (../shared/device/README.md):
#   PHASE=check : GPU 0 runs the GPU tests (CUDA graphs, no host sync, fused kernels, sampling); GPU 1 runs a small
#                 sweep (no-spec, fixed-7, adaptive at C = 1, 64, 256, T = 0).
#   PHASE=diag  : GPU 0 runs the GPU tests, then traces plain and drafting steps (no-spec, adaptive held plain,
#                 fixed-7) at C = 1 and 256 under torch.profiler; the last GPU times the step's phases at C = 1, 16, 256,
#                 then sweeps no-spec and adaptive at C = 1, 16, 256, 1024 (T = 0, one wave).
#   PHASE=quiet  : no-spec, no-spec:sync, adaptive, fixed-1 at C = 1..1024, 3 rounds, T = 0 (with hf at C = 256) on
#                 GPU 0 and T = 1 on the last, nothing else running (the goal's comparison; async scheduling's gain).
#                 QUIET_ARMS and QUIET_REPEATS change the arms and the rounds; QUIET_INTERLEAVE=1 interleaves them
#                 row by row (bench sweep --interleave).
#   PHASE=goal  : the goal's comparison on GPU 0 alone, in one process: no-spec, adaptive and fixed-1 built once each
#                 (bench sweep --interleave, 0.9 of the memory between them), taking turns row by row at C = 1..1024,
#                 T = 0 and 1, GOAL_REPEATS (7) rounds; the table's paired column is the median of per-round ratios.
#   PHASE=prefill: the phases of a prefill step, no-spec against adaptive, at C = 1 and 16, async and sync
#                 (prefill_profile.py) on the last GPU; the GPU tests on GPU 0.
#   PHASE=verify : the GPU tests on GPU 0; the t1-check (a fresh engine's first row, T = 1) on the last GPU.
#   PHASE=ab     : verify_plain against verify()'s row-by-row path (step_profile.py fixed-k configs) at C = 1, 64,
#                 256, T = 1 then 0, alone on the last GPU.
#   PHASE=plan   : planning's share of a drafting step at C = 256 and 1024 (step_profile.py adaptive-drafting).
#   PHASE=hostgap: the host's own work in adaptive's plain steps against no-spec's (step_profile.py, "busy" = wall
#                 less event waits) at C = 64 and 256, T = 1 (HOSTGAP_TEMPS, HOSTGAP_CONCS, HOSTGAP_CONFIGS), the
#                 configs alternating; then the top host functions (--cprofile) of each at the first C. Adaptive runs
#                 with its regime free (it asks the cost model, as in the sweep; it does not draft there).
#   PHASE=abtree : host changes against an older commit in one window (the host's speed moved 1.5-2x between windows
#                 in benchmarks/results/h200/gpu-path/2026-12-01-3229528): step_profile.py from .ab/base
#                 (benchmarks/gpu/ab_prepare.sh REV, carried as ".ab") and from this tree, alternating AB_ROUNDS (3)
#                 times at AB_CONCS (256 1024), AB_CONFIGS (no-spec), T = AB_TEMP (0). Each process imports its own
#                 tree's dspark (PYTHONPATH first); the drafter's weights are this tree's (linked).
#   PHASE=invariant: batch_invariant mode (--batch-invariant): no-spec, fixed-7 and adaptive at C = 1, 16, 256 (T = 0,
#                 greedy identity with no-spec per row), then no-spec without it at the same C: the mode's cost.
#   PHASE=attention: the attention kernel against the copy roofline, and the step-cost curves (plot).
#   PHASE=sweep : the full sweep, one temperature per GPU (T = 0 on GPU 0, T = 1 on the last), with the hf arm.
#   PHASE=serve : `dspark serve` per arm (no-spec, fixed-7, adaptive) on GPU 0, loaded by
#                 `dspark bench serve` with GSM8K prompts at C = 1, 16, 256 (256 tokens, ignore_eos, T = 0).
# The GPU tests get 420 s: on a fresh machine they took more than 330 s on 2026-11-30 (engine start-ups: GGUF parse,
# Triton compiles, graph capture), and were cut there.
# Everything lands in $OUT. Usage there: source .device/setup.sh && PHASE=check bash benchmarks/gpu/run_h200.sh
# The prompts: .device/data, made here by benchmarks/gpu/data_prepare.sh and carried.
set -uo pipefail
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
DATA=${DATA:-.device/data}
PHASE=${PHASE:-check}
mkdir -p "$OUT"
NG=$(nvidia-smi -L | wc -l)
LAST=$((NG - 1))
SPEC='{"method": "dspark"}'
CONCS=${CONCS:-"1 16 32 64 128 256 512 1024"}
[ "$PHASE" = final ] && CONCS=${FINAL_CONCS:-"1 16 256 1024"}
quiet() { tr '\r' '\n' | grep -v "it/s\|s/it" ; }
on() { CUDA_VISIBLE_DEVICES=$1 timeout "$2" "${@:3}"; }

if [ "$PHASE" = check ]; then
  (on 0 420 python -m pytest -q -m gpu -s tests/ 2>&1 | quiet \
    > "$OUT/gpu-tests.log") &
  (on "$LAST" 170 python -m dspark bench sweep --device cuda --speculative-config "$SPEC" --arm no-spec \
      --arm fixed-7 --arm adaptive --concurrency 1 64 256 --temperature 0 --output-len 128 --data-dir "$DATA" \
      --output-json "$OUT/check-sweep.json" 2>&1 | quiet | tail -12) > "$OUT/check-last.log" 2>&1 &
  wait
  grep -v "^\.*$" "$OUT/gpu-tests.log" | tail -40
  cat "$OUT/check-last.log"
elif [ "$PHASE" = profile ]; then
  (on 0 150 python -m pytest -q -m gpu -x tests/ -k "graphs or sync or sampling" \
    tests/models/test_fused_ops.py 2>&1 | quiet | tail -25 > "$OUT/gpu-tests.log") &
  (on "$LAST" 150 python benchmarks/gpu/step_profile.py --device cuda --concurrency 1 64 256 \
    --output "$OUT/step-profile.json" > "$OUT/step-profile.log" 2>&1) &
  wait
  cat "$OUT/gpu-tests.log" "$OUT/step-profile.log" | grep -v "it/s\|s/it"
elif [ "$PHASE" = diag ]; then
  (
    on 0 420 python -m pytest -q -m gpu tests/ 2>&1 | quiet | tail -30 \
      > "$OUT/gpu-tests.log"
    on 0 200 python benchmarks/gpu/plain_step_trace.py --concurrency 1 256 --config no-spec adaptive fixed-7 \
      --steps 20 --top 15 > "$OUT/step-trace.log" 2>&1
  ) &
  (
    on "$LAST" 200 python benchmarks/gpu/step_profile.py --device cuda --concurrency 1 16 256 --steps 40 \
      --output "$OUT/step-profile.json" > "$OUT/step-profile.log" 2>&1
    [ "${DIAG_SWEEP_S:-330}" -gt 0 ] && on "$LAST" "${DIAG_SWEEP_S:-330}" python -m dspark bench sweep --device cuda --speculative-config "$SPEC" \
      --arm no-spec --arm adaptive --concurrency 1 16 256 1024 --temperature 0 --output-len 256 --waves 1 \
      --max-num-batched-tokens 8192 --gpu-memory-utilization 0.6 --data-dir "$DATA" \
      --output-json "$OUT/diag-sweep.json" 2>&1 | quiet > "$OUT/diag-sweep.log"
  ) &
  wait
  cat "$OUT/gpu-tests.log"
  grep -v "it/s\|s/it" "$OUT/step-profile.log" | grep -v "^ *$" | tail -20
  grep "^==" "$OUT/step-trace.log"
  grep "ROW" "$OUT/diag-sweep.log" | sed 's/ ROW.*//'
  tail -12 "$OUT/diag-sweep.log"
elif [ "$PHASE" = quiet ]; then
  # The goal's comparison with nothing else on the machine: one temperature per GPU, 3 alternating rounds, async
  # scheduling's gain in the same run (no-spec:sync), hf at C = 256 at T = 0.
  # QUIET_TEMPS="0" (or "1") runs one temperature alone: a replicate with both at once on one host swung
  # by 20-25% between rounds (benchmarks/results/h200/gpu-path/2026-11-30-3d0913e, run C).
  for i in 0 "$LAST"; do
    t=$([ "$i" = 0 ] && echo 0 || echo 1); hf=$([ "$i" = 0 ] && echo "--hf-concurrency 256")
    case " ${QUIET_TEMPS:-0 1} " in *" $t "*) ;; *) continue ;; esac
    arms=$(for a in ${QUIET_ARMS:-no-spec no-spec:sync adaptive fixed-1}; do printf -- "--arm %s " "$a"; done)
    # QUIET_INTERLEAVE=1: the arms' engines side by side, taking turns row by row (bench sweep --interleave), with
    # 0.9 of the memory split between them (each engine reserves ~18 GB of step headroom at 8192 batched tokens;
    # C = 1024 needs ~11 GB of KV cache, estimated at ~450 tokens a request). Not run on the GPU yet.
    mem=$([ "${QUIET_INTERLEAVE:-0}" = 1 ] && echo "--interleave --gpu-memory-utilization 0.9" \
      || echo "--gpu-memory-utilization 0.6")
    (on "$i" "${QUIET_S:-540}" python -m dspark bench sweep --device cuda --speculative-config "$SPEC" $arms \
      --concurrency 1 16 64 256 1024 --temperature "$t" --repeats "${QUIET_REPEATS:-3}" \
      --output-len 256 --waves 1 --max-num-batched-tokens 8192 $mem $hf --data-dir "$DATA" \
      --output-json "$OUT/quiet-t$t.json" --output-md "$OUT/quiet-t$t.md" --output-plot "$OUT/quiet-t$t.png" 2>&1 \
      | quiet > "$OUT/quiet-t$t.log") &
  done
  wait
  tail -n 12 "$OUT"/quiet-t*.log
elif [ "$PHASE" = goal ]; then
  arms=$(for a in ${GOAL_ARMS:-no-spec adaptive fixed-1}; do printf -- "--arm %s " "$a"; done)
  on 0 "${GOAL_S:-560}" python -m dspark bench sweep --device cuda --speculative-config "$SPEC" $arms --interleave \
    --concurrency ${GOAL_CONCS:-1 16 64 256 1024} --temperature 0 1 --repeats "${GOAL_REPEATS:-7}" --output-len 256 \
    --waves 1 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 --data-dir "$DATA" \
    --output-json "$OUT/goal.json" --output-md "$OUT/goal.md" --output-plot "$OUT/goal.png" 2>&1 | quiet \
    > "$OUT/goal.log"
  grep ROW "$OUT/goal.log" | sed 's/ ROW.*//' | tail -40; tail -3 "$OUT/goal.log"; cat "$OUT/goal.md"
elif [ "$PHASE" = prefill ]; then
  # A lead from benchmarks/results/h200/gpu-path/2026-11-30-6e5334e: adaptive's prefill steps cost 11-16 ms more
  # than no-spec's. The phases of a prefill step with async scheduling (and one step under torch.profiler), then
  # without, on the last GPU; GPU 0 runs the GPU tests.
  (on 0 420 python -m pytest -q -m gpu tests/ 2>&1 | quiet | tail -30 \
    > "$OUT/gpu-tests.log") &
  (
    on "$LAST" 240 python benchmarks/gpu/prefill_profile.py --device cuda --concurrency 1 16 --data-dir "$DATA" \
      --trace > "$OUT/prefill-profile.log" 2>&1
    on "$LAST" 170 python benchmarks/gpu/prefill_profile.py --device cuda --concurrency 1 16 --data-dir "$DATA" \
      --no-async-scheduling > "$OUT/prefill-profile-sync.log" 2>&1
  ) &
  wait
  grep -A1 "prefill step" "$OUT"/prefill-profile*.log
  cat "$OUT/gpu-tests.log"
elif [ "$PHASE" = verify ]; then
  # The GPU tests on GPU 0; on the last GPU a fresh engine's first row at T = 1 (the t1-check:
  # no-spec and adaptive at C = 64 and 256 after a 4-token warm-up, 3 rounds), which counts the steps that drafted.
  (on 0 420 python -m pytest -q -m gpu tests/ \
    tests/models/test_fused_ops.py 2>&1 | quiet | tail -30 > "$OUT/gpu-tests.log") &
  (on "$LAST" "${T1CHECK_S:-300}" python -m dspark bench sweep --device cuda --speculative-config "$SPEC" \
    --arm no-spec --arm adaptive --concurrency 64 256 --temperature 1 --repeats 3 --output-len 256 --waves 1 \
    --max-num-batched-tokens 8192 --gpu-memory-utilization 0.6 --data-dir "$DATA" --output-json "$OUT/t1-check.json" \
    --output-md "$OUT/t1-check.md" 2>&1 | quiet > "$OUT/t1-check.log") &
  wait
  cp "${DSPARK_CACHE:-$HOME/.cache/dspark}"/cost_models/*.json "$OUT/" 2>/dev/null
  cat "$OUT/gpu-tests.log"
  grep ROW "$OUT/t1-check.log" | sed 's/ ROW.*//'; cat "$OUT/t1-check.md"
elif [ "$PHASE" = ab ]; then
  # Verification decided on the device (verify_plain) against the row-by-row path (verify(), configs
  # *-rowwise), fixed-1 and fixed-7 at C = 1, 64, 256 (AB_TEMPS: 1 0), alone on the last GPU, the two paths alternating.
  for t in ${AB_TEMPS:-1 0}; do
    on "$LAST" "${AB_S:-250}" python benchmarks/gpu/step_profile.py --device cuda --concurrency 1 64 256 --steps 30 \
      --config fixed-1-rowwise fixed-1 fixed-7-rowwise fixed-7 --temperature $t \
      --output "$OUT/verify-profile-t$t.json" 2>&1 | quiet | grep -v "^ *$" > "$OUT/verify-profile-t$t.log"
  done
  grep "ms/step" "$OUT"/verify-profile-t*.log
elif [ "$PHASE" = plan ]; then
  # The goal "budget choice and allocation under 2% of a step at C = 1024": every step plans (the regime held to
  # drafting); plan.choose_budget and plan.allocate are timed on their own. Nothing else runs.
  on 0 170 python benchmarks/gpu/step_profile.py --device cuda --concurrency 256 1024 --config adaptive-drafting \
    no-spec --steps 20 --output "$OUT/step-profile-plan.json" 2>&1 | quiet | grep -v "^ *$" | tail -12
elif [ "$PHASE" = hostgap ]; then
  # The host's own work ("busy": wall less event waits) of adaptive's plain steps against no-spec's, the configs
  # alternating, then the top host functions (--cprofile) of each at the first concurrency.
  for t in ${HOSTGAP_TEMPS:-1}; do
    on 0 "${HOSTGAP_S:-200}" python benchmarks/gpu/step_profile.py --device cuda --concurrency ${HOSTGAP_CONCS:-64 256} \
      --config ${HOSTGAP_CONFIGS:-no-spec adaptive no-spec adaptive} --steps 200 --temperature "$t" \
      --output "$OUT/hostgap-t$t.json" 2>&1 | quiet | grep -v "^ *$" > "$OUT/hostgap-t$t.log"
    grep "ms/step" "$OUT/hostgap-t$t.log"
  done
  c=$(echo ${HOSTGAP_CONCS:-64 256} | cut -d' ' -f1)
  for cfg in no-spec adaptive; do
    on 0 100 python benchmarks/gpu/step_profile.py --device cuda --concurrency "$c" --config $cfg --steps 100 \
      --temperature "$(echo ${HOSTGAP_TEMPS:-1} | cut -d' ' -f1)" --cprofile 30 > "$OUT/cprofile-$cfg.log" 2>&1
  done
  grep "ms/step" "$OUT"/cprofile-*.log
elif [ "$PHASE" = abtree ]; then
  [ -d .ab/base/dspark ] || { echo "abtree: run benchmarks/gpu/ab_prepare.sh REV first and carry .ab" >&2; exit 2; }
  ln -sfn "$PWD/dspark/assets" .ab/base/dspark/assets
  for r in $(seq "${AB_ROUNDS:-3}"); do
    for tree in "$PWD/.ab/base" "$PWD"; do
      name=$([ "$tree" = "$PWD" ] && echo this || echo base)
      [ "$r" = 1 ] && (cd "$tree" && PYTHONPATH="$tree:$PYTHONPATH" python -c "import dspark; print('$name:', \
        dspark.__file__)" | tee -a "$OUT/abtree.log")
      (cd "$tree" && PYTHONPATH="$tree:$PYTHONPATH" on 0 "${AB_S:-150}" python benchmarks/gpu/step_profile.py \
        --device "${AB_DEVICE:-cuda}" --concurrency ${AB_CONCS:-256 1024} --config ${AB_CONFIGS:-no-spec} \
        --steps "${AB_STEPS:-100}" --temperature "${AB_TEMP:-0}" 2>&1 | quiet | grep "ms/step" \
        | sed "s/^/$name r$r: /" | tee -a "$OUT/abtree.log")
    done
  done
elif [ "$PHASE" = invariant ]; then
  for mode in invariant default; do
    flag=$([ "$mode" = invariant ] && echo "--batch-invariant"); arms=$([ "$mode" = invariant ] \
      && echo "${INVARIANT_ARMS:---arm no-spec --arm fixed-7 --arm adaptive}" || echo "--arm no-spec")
    on 0 "${INVARIANT_S:-280}" python -m dspark bench sweep --device cuda --speculative-config "$SPEC" $arms $flag \
      --concurrency 1 16 256 --temperature 0 --output-len 256 --waves 1 --max-num-batched-tokens 8192 \
      --gpu-memory-utilization 0.6 --data-dir "$DATA" --output-json "$OUT/invariant-$mode.json" \
      --output-md "$OUT/invariant-$mode.md" 2>&1 | quiet > "$OUT/invariant-$mode.log"
  done
  cat "$OUT"/invariant-*.md
elif [ "$PHASE" = attention ]; then
  on 0 120 python benchmarks/gpu/bench_attention.py --output "$OUT/attention.json" 2>&1 | quiet
  on 0 150 python -m dspark profile --device cuda --speculative-config "$SPEC" \
    --output-json "$OUT/h200-cost-dspark.json" --output-plot "$OUT/h200-cost-dspark.png" 2>&1 | quiet | tail -15
elif [ "$PHASE" = final ]; then
  # What fits in a few minutes of device time: GPU 0 sweeps T = 0 with the hf arm at C = 256; the last GPU
  # profiles the step's phases, then sweeps T = 1. One wave of C prompts per row, four arms, four concurrencies.
  ARMS="--arm no-spec --arm adaptive --arm fixed-7 --arm fixed-3"
  sweep() {
    on "$1" "$3" python -m dspark bench sweep --device cuda --speculative-config "$SPEC" --concurrency $CONCS $ARMS \
      --temperature "$2" --output-len 256 --waves 1 --max-num-batched-tokens 8192 $4 \
      --data-dir "$DATA" --output-json "$OUT/h200-sweep-t$2.json" --output-plot "$OUT/h200-sweep-t$2.png" \
      --output-md "$OUT/h200-sweep-t$2.md" 2>&1 | quiet > "$OUT/sweep-t$2.log"
  }
  (sweep 0 0 "${SWEEP_S:-320}" "--hf-concurrency 256") &
  (
    on "$LAST" 70 python benchmarks/gpu/step_profile.py --device cuda --concurrency 1 256 --steps 30 \
      --output "$OUT/step-profile.json" 2>&1 | quiet > "$OUT/step-profile.log"
    sweep "$LAST" 1 "$((${SWEEP_S:-320} - 72))" ""
  ) &
  wait
  cat "$OUT/step-profile.log"
  grep -h "tok/s ROW" "$OUT"/sweep-t*.log | sed 's/ ROW.*//'
  cat "$OUT"/h200-sweep-t*.md 2>/dev/null
elif [ "$PHASE" = serve ]; then
  GSM=$DATA/deepspec_eval/gsm8k.jsonl
  declare -A CFG=([no-spec]="" [fixed-7]='{"method": "dspark", "num_speculative_tokens": 7, "enable_adaptive_verification": false}'
    [adaptive]='{"method": "dspark", "num_speculative_tokens": 7}')
  for arm in no-spec fixed-7 adaptive; do
    spec=()
    [ -n "${CFG[$arm]}" ] && spec=(--speculative-config "${CFG[$arm]}")
    CUDA_VISIBLE_DEVICES=0 python -m dspark serve --device "${DEVICE:-cuda}" --port 8123 --max-num-seqs 256 \
      --gpu-memory-utilization 0.6 "${spec[@]}" > "$OUT/serve-$arm.log" 2>&1 &
    pid=$!
    for _ in $(seq 240); do curl -sf http://127.0.0.1:8123/health > /dev/null && break; sleep 0.5; done
    for c in ${SERVE_CONCS:-1 16 256}; do
      n=$((c < 16 ? 16 : c))
      timeout 120 python -m dspark bench serve --base-url http://127.0.0.1:8123 --dataset-name gsm8k \
        --dataset-path "$GSM" --num-prompts "$n" --max-concurrency "$c" --output-len "${SERVE_LEN:-256}" --ignore-eos \
        --temperature 0 --disable-tqdm --save-result --result-dir "$OUT" --result-filename "serve-$arm-c$c.json" \
        2>&1 | grep -i "throughput\|acceptance length\|failed\|error" | sed "s/^/$arm C=$c /"
    done
    kill "$pid"; wait "$pid" 2> /dev/null
  done
elif [ "$PHASE" = sweep ]; then
  for i in 0 "$LAST"; do
    t=$([ "$i" = 0 ] && echo 0 || echo 1)
    (on "$i" ${SWEEP_S:-555} python -m dspark bench sweep --device cuda --speculative-config "$SPEC" --concurrency $CONCS \
      --temperature "$t" --output-len 256 --max-num-batched-tokens 8192 --hf-concurrency 256 --data-dir "$DATA" \
      --output-json "$OUT/h200-sweep-t$t.json" --output-plot "$OUT/h200-sweep-t$t.png" \
      --output-md "$OUT/h200-sweep-t$t.md" ${SWEEP_ARGS:-} 2>&1 | quiet > "$OUT/sweep-t$t.log") &
  done
  wait
  tail -5 "$OUT"/sweep-t*.log
  cat "$OUT"/h200-sweep-t*.md
fi
