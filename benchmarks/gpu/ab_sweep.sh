#!/usr/bin/env bash
# Two trees side by side in one GPU window: `bench sweep` of each tree's own code, the trees taking turns round by
# round (AB_ROUNDS, default 3), each round one process per tree with its arms (AB_ARMS) at AB_CONCS, T = 0, one wave
# of 256 tokens, the shipped DSpark drafter. Prepare the trees here first (they travel in .ab):
#   bash benchmarks/gpu/ab_sweep.sh prepare 868d95f 90305af
# then on the GPU machine, after staging (../shared/device/README.md), with carry [".ab", ".device/data", ...]:
#   source .device/setup.sh && bash benchmarks/gpu/ab_sweep.sh run
# It writes ab-<tree>-<round>.json and ab-summary.json (per-round ratios of the second tree to the first, and their
# median) under $OUT.
set -uo pipefail
if [ "${1:-}" = prepare ]; then
  rm -rf .ab && mkdir -p .ab
  for rev in "${@:2}"; do
    mkdir -p ".ab/$rev" && git archive "$rev" dspark | tar -x -C ".ab/$rev" --exclude="dspark/assets"
  done
  printf '%s\n' "${@:2}" > .ab/ORDER
  du -sh .ab
  exit 0
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
DATA=${DATA:-.device/data}
mkdir -p "$OUT"
ROOT=$PWD
mapfile -t TREES < .ab/ORDER
for t in "${TREES[@]}"; do ln -sfn "$PWD/dspark/assets" ".ab/$t/dspark/assets"; done
arms=$(for a in ${AB_ARMS:-no-spec adaptive}; do printf -- "--arm %s " "$a"; done)
for round in $(seq 1 "${AB_ROUNDS:-3}"); do
  for t in "${TREES[@]}"; do
    # From the tree's own folder: `python -m` puts the working directory first on sys.path.
    (cd ".ab/$t" && timeout "${AB_S:-200}" python -m dspark bench sweep --device cuda \
      --speculative-config '{"method": "dspark"}' $arms --concurrency ${AB_CONCS:-1 256} --temperature 0 \
      --waves 1 --output-len 256 --data-dir "$ROOT/$DATA" --output-json "$OUT/ab-$t-$round.json") \
      > "$OUT/ab-$t-$round.log" 2>&1
    echo "round $round tree $t rc=$? $(tail -1 "$OUT/ab-$t-$round.log")"
  done
done
python - "$OUT" "${TREES[@]}" <<'PY'
import json, statistics, sys
from pathlib import Path
out, trees = Path(sys.argv[1]), sys.argv[2:]
a, b = trees[0], trees[-1]
ratios, tput = {}, {}
for f in sorted(out.glob(f"ab-{a}-*.json")):
    rnd = f.stem.rsplit("-", 1)[1]
    g = out / f"ab-{b}-{rnd}.json"
    if not g.exists():
        continue
    rows_a = {(r["arm"], r["concurrency"]): r["output_throughput"] for r in json.loads(f.read_text())["rows"]}
    rows_b = {(r["arm"], r["concurrency"]): r["output_throughput"] for r in json.loads(g.read_text())["rows"]}
    for key in rows_a.keys() & rows_b.keys():
        ratios.setdefault(f"{key[0]} C={key[1]}", []).append(rows_b[key] / rows_a[key])
        tput.setdefault(f"{key[0]} C={key[1]}", []).append((rows_a[key], rows_b[key]))
summary = {k: {"ratios": [round(x, 4) for x in v], "median": round(statistics.median(v), 4), "tok_s": tput[k]}
           for k, v in sorted(ratios.items())}
(out / "ab-summary.json").write_text(json.dumps({"first": a, "second": b, "rows": summary}, indent=1))
for k, v in summary.items():
    print(f"{k:22s} {b}/{a} = {v['median']:.3f}  rounds {v['ratios']}")
PY
