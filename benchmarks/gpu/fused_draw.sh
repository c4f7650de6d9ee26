#!/usr/bin/env bash
# The fused draw (dspark/speculative/drafters/dspark/draw_kernel.py) against the torch loop it replaced, on one H200.
# First its GPU tests (the compiled kernel against the twin; pipelined steps: graphs against eager, async against
# sync), then fixed-7 DSpark at T = 1, C = 1, 16, 64, 256 tokens with EOS ignored, one process per arm, the arms
# alternating FUSED_ROUNDS (3) times (DSPARK_FUSED_DRAW=0: the torch loop; 1: the kernel). Each row has its output
# throughput and a decode step's median wall and device ms; the summary gives, per C, the median over rounds of
# kernel / loop for each. The tests are cut at 240 s and each sweep at 150 s (not yet timed there). Run after staging:
#   source .device/setup.sh && bash benchmarks/gpu/fused_draw.sh
# It writes fused-draw.json and fused-draw.log under $OUT (default: benchmarks/results/h200).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/h200}
DATA=${DATA:-.device/data}
TMP=$(mktemp -d)
mkdir -p "$OUT"
{
  timeout 240 python -m pytest -q -m gpu tests/speculative/drafters/test_draw_kernel.py \
    tests/worker/test_spec_pipeline_gpu.py tests/engine/test_async_scheduling_gpu.py 2>&1 | tail -5
  for round in $(seq "${FUSED_ROUNDS:-3}"); do
    for fused in 0 1; do
      DSPARK_FUSED_DRAW=$fused timeout 150 python -m dspark bench sweep --device cuda \
        --speculative-config '{"method": "dspark"}' --arm fixed-7 --concurrency ${FUSED_CONCS:-1 16 64} \
        --temperature 1 --repeats 1 --output-len 256 --waves 1 --max-num-batched-tokens 4096 \
        --gpu-memory-utilization 0.5 --data-dir "$DATA" --output-json "$TMP/r$round-f$fused.json" 2>&1 | tail -4
    done
  done
  python - "$TMP" "$OUT/fused-draw.json" <<'PY'
import glob, json, statistics, subprocess, sys, time
rows = {}
for path in sorted(glob.glob(sys.argv[1] + "/r*-f*.json")):
    name = path.rsplit("/", 1)[1][:-5]
    rnd, fused = name.split("-")
    for row in json.load(open(path))["rows"]:
        rows.setdefault(row["concurrency"], {}).setdefault(rnd, {})[fused] = row
summary = {}
for c, rounds in sorted(rows.items()):
    paired = [r for r in rounds.values() if "f0" in r and "f1" in r]
    ratio = {k: [r["f1"][k] / r["f0"][k] for r in paired if r["f0"].get(k) and r["f1"].get(k)]
             for k in ("output_throughput", "step_wall_ms", "step_device_ms")}
    summary[c] = {f"{k}_kernel_over_loop": {"rounds": v, "median": statistics.median(v) if v else None}
                  for k, v in ratio.items()}
    summary[c]["rounds"] = [{arm: {k: r[arm].get(k) for k in ("output_throughput", "acceptance_length",
                                                                "step_wall_ms", "step_device_ms")}
                             for arm in ("f0", "f1")} for r in paired]
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
out = {"command": "bash benchmarks/gpu/fused_draw.sh", "commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
       "arms": {"f0": "DSPARK_FUSED_DRAW=0 (torch loop)", "f1": "DSPARK_FUSED_DRAW=1 (kernel)"},
       "by_concurrency": summary}
json.dump(out, open(sys.argv[2], "w"), indent=1)
for c, s in summary.items():
    print(c, {k: round(v["median"], 3) for k, v in s.items() if isinstance(v, dict) and v.get("median")})
PY
} 2>&1 | tee "$OUT/fused-draw.log"
rm -rf "$TMP"
