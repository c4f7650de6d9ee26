#!/usr/bin/env bash
# Fine-tunes the shipped SmolLM2-135M-Instruct drafter on fresh answers of the target, chat-heavier than the data it
# was trained on, in ONE run of about 7 minutes on one H200 (issue 27): benchmarks/drafter/run_scale.sh with
# PHASE="gen train finish" and INIT set to the shipped drafter.
# - gen (GEN_S): the target writes MAGPIE user turns for PROMPT_S seconds, then answers those and PPS prompts per pool
#   source, once at T = 1 and once at T = 0;
# - train (MAIN_S): --init-from the shipped drafter, a fresh schedule of MAIN_STEPS to peak LR, annealed to zero;
# - finish: calibrate (CAL_PROMPTS held-out prompts, a fit at each of CAL_TEMPS, default "1"), then eval-drafter at
#   T = 0 and T = 1, first 80 prompts of gsm8k, humaneval, mbpp and mt-bench.
# Every setting can be overridden from the environment. Needs .device/data (below) and the staged model:
#   mkdir -p .device/data/deepspec_eval && cp -r ../shared/data/{gsm8k,mbpp,alpaca,llamafactory} .device/data/ &&
#   cp ../shared/data/deepspec_eval/{gsm8k,humaneval,mbpp,mt-bench}.jsonl .device/data/deepspec_eval/
#   then, on the GPU machine: source .device/setup.sh && bash benchmarks/gpu/drafter_tune.sh   (results under $OUT)
set -uo pipefail
export PHASE="gen train finish" INIT=${INIT:-dspark/assets/smollm2-135m-dspark} DATA=${DATA:-.device/data}
export GEN_S=${GEN_S:-140} PROMPT_S=${PROMPT_S:-25} MAGPIE=${MAGPIE:-20000} FOLLOW_UPS=${FOLLOW_UPS:-0}
export PPS=${PPS:-2500} SPP=${SPP:-1}
export MAIN_S=${MAIN_S:-110} MAIN_STEPS=${MAIN_STEPS:-850} LR=${LR:-3e-4}
export CAL_PROMPTS=${CAL_PROMPTS:-100} CAL_S=${CAL_S:-60} EVAL_S=${EVAL_S:-90}
export PYTHON=${PYTHON:-python3}
exec bash benchmarks/drafter/run_scale.sh
