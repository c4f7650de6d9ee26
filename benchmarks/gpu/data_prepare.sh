#!/usr/bin/env bash
# Prepares .device/data (git-ignored): the default prompt mix's files from ../shared/data, which run_h200.sh and the
# drafter scripts read on the GPU machine (it has no ../shared; the folder travels as a carried path, ~0.6 MB).
#   bash benchmarks/gpu/data_prepare.sh      then carry ".device/data" in the first run that needs prompts
set -euo pipefail
src=${1:-../shared/data/deepspec_eval}
mkdir -p .device/data/deepspec_eval
cp "$src"/gsm8k.jsonl "$src"/mt-bench.jsonl "$src"/humaneval.jsonl .device/data/deepspec_eval/
du -sh .device/data
