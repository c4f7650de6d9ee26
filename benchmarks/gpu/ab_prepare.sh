#!/usr/bin/env bash
# Prepares .ab/base: commit REV's dspark/ and benchmarks/ (without the drafter's weights, which PHASE=abtree links to
# this tree's), for run_h200.sh's PHASE=abtree, which times it against this tree in one GPU window. Carry ".ab".
#   bash benchmarks/gpu/ab_prepare.sh 5c42169
set -euo pipefail
rev=${1:?usage: ab_prepare.sh REV}
rm -rf .ab/base && mkdir -p .ab/base
git archive "$rev" dspark benchmarks/gpu | tar -x -C .ab/base --exclude="dspark/assets"
echo "$rev" > .ab/base/REV
du -sh .ab/base
