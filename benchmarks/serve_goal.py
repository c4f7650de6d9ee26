"""The server against the engine it serves, in one run: `dspark serve` (a subprocess, its core in a process of its own)
and an offline LLMEngine of the same configuration, taking turns at each concurrency for --rounds rounds, on the same
prompts (completions, the prompt text as is), greedy, --output-len tokens with EOS ignored. Offline: the prompts
through LLMEngine with at most C in flight (bench/throughput.py's run_dspark). Served: `dspark bench serve`'s client
(streamed, usage from the last chunk) with --max-concurrency C, in up to --client-workers processes, against a
server of --api-server-count API servers. Each row: both output throughputs (medians over the rounds), the median of
the per-round ratios, and each served run's CPU use by process (CPU seconds per second: the launcher, the core, each
API server, the client), which says what would saturate first.

    python benchmarks/serve_goal.py --device cuda --dataset-path .device/data/deepspec_eval/gsm8k.jsonl \
        --concurrency 1 16 64 256 --rounds 3 --output-json serve-goal.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from dspark.bench.client import Endpoint, run_async
from dspark.bench.serve import run_benchmark
from dspark.bench.serve_data import sample_prompts
from dspark.bench.throughput import run_dspark
from dspark.config import EngineConfig
from dspark.engine.llm_engine import LLMEngine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except urllib.error.HTTPError as e:
            if e.code != 503 or b"starting" not in e.read():
                raise SystemExit(f"the server's engine failed: HTTP {e.code}") from None
        except OSError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"the server was not healthy within {timeout:.0f} s")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _role(pid: int) -> str:
    """What a child of `dspark serve` is: API servers lead their own process groups, the core does not."""
    if b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes():
        return "tracker"
    return "api_server" if os.getpgid(pid) == pid else "core"


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--dataset-path", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts-per-concurrency", type=int, default=4, help="C x this many prompts a row (min 8)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="each of the two engines' share")
    ap.add_argument("--api-server-count", type=int, default=4, help="dspark serve --api-server-count")
    ap.add_argument(
        "--client-workers", type=int, default=4, help="client processes (bench serve --num-workers), at most C"
    )
    ap.add_argument("--idle-seconds", type=float, default=5.0, help="measure the idle server's CPU this long")
    ap.add_argument("--output-json", required=True)
    args = ap.parse_args()

    engine_args = {
        "device": args.device,
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "dspark", "serve", "--port", str(port), "--log-level", "warning"]
    cmd += ["--api-server-count", str(args.api_server_count)]
    for key, value in engine_args.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    server = subprocess.Popen(cmd)
    try:
        # The server first: an engine sizes its KV cache from the memory free when it starts, so the offline one,
        # built second, may use up to the server's share plus its own.
        ready_s = _wait_healthy(url, server, 600)
        print(f"server healthy after {ready_s:.1f} s", flush=True)
        offline_args = dict(engine_args)
        if args.device == "cuda":
            offline_args["gpu_memory_utilization"] = min(0.95, 2 * args.gpu_memory_utilization)
        engine = LLMEngine(EngineConfig(**offline_args))
        tokenizer = engine.tokenizer
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
            model = json.loads(r.read())["data"][0]["id"]
        endpoint = Endpoint(url, "openai", "/v1/completions", model)
        largest = max(args.concurrency)
        prompts = sample_prompts(
            "jsonl",
            max(8, largest * args.prompts_per_concurrency),
            dataset_path=args.dataset_path,
            tokenizer=tokenizer,
            output_len=args.output_len,
        )
        ids = [engine.input_processor.encode(p.text) for p in prompts]
        # Warm both: first shapes, graph replays, every API server (connections spread over them).
        run_dspark(engine, ids[:32], 16, concurrency=32)
        run_async(run_benchmark(endpoint, prompts[:32], ignore_eos=True, max_concurrency=32, progress=False))

        core_pids = _children(server.pid)  # the core, the API servers, multiprocessing's resource tracker
        roles = ["launcher", *(_role(p) for p in core_pids), "client"]
        idle = {}
        if args.idle_seconds > 0:
            pids = [server.pid, *core_pids]
            before = [_cpu_seconds(p) for p in pids]
            time.sleep(args.idle_seconds)
            used = [_cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)]
            idle = {"seconds": args.idle_seconds, "front_cpu_frac": used[0] / args.idle_seconds}
            idle["core_cpu_frac"] = sum(used[1:]) / args.idle_seconds
            print(f"idle: front {idle['front_cpu_frac']:.2%} of a core, core {idle['core_cpu_frac']:.2%}", flush=True)

        rows: dict[int, dict[str, list[Any]]] = {
            c: {"offline": [], "served": [], "cpu_busy": []} for c in args.concurrency
        }
        for r in range(args.rounds):
            for c in args.concurrency:
                n = max(8, c * args.prompts_per_concurrency)
                off = run_dspark(engine, ids[:n], args.output_len, concurrency=c)
                pids = [server.pid, *core_pids]
                cpu_before = [_cpu_seconds(p) for p in pids]
                srv = run_async(
                    run_benchmark(
                        endpoint,
                        prompts[:n],
                        ignore_eos=True,
                        max_concurrency=c,
                        progress=False,
                        num_workers=min(c, args.client_workers),
                    )
                )
                used = [_cpu_seconds(p) - b for p, b in zip(pids, cpu_before, strict=True)] + [srv["client_cpu_s"]]
                # CPU seconds per second of the run, by process (the client: all its workers): what saturates first
                busy = [u / srv["duration"] for u in used]
                named = zip(roles, busy, strict=True)
                rows[c]["cpu_busy"].append({f"{role}:{i}": round(b, 3) for i, (role, b) in enumerate(named)})
                if srv["failed"]:
                    print(f"C={c}: {srv['failed']} requests failed: {srv['errors'][:3]}", flush=True)
                offline_tps = off.output_throughput
                rows[c]["offline"].append(offline_tps)
                rows[c]["served"].append(srv["output_throughput"])
                print(
                    f"round {r} C={c}: offline {offline_tps:.1f} tok/s, served {srv['output_throughput']:.1f} "
                    f"({srv['output_throughput'] / offline_tps:.2f}x), served median TPOT {srv['median_tpot_ms']:.2f}"
                    f" ms, {srv['completed']} requests",
                    flush=True,
                )
        table = []
        for c, row in rows.items():
            ratios = [s / o for s, o in zip(row["served"], row["offline"], strict=True)]
            table.append(
                {
                    "concurrency": c,
                    "offline_tok_s": statistics.median(row["offline"]),
                    "served_tok_s": statistics.median(row["served"]),
                    "ratio": statistics.median(ratios),
                    "rounds": {"offline": row["offline"], "served": row["served"]},
                    "cpu_busy": row["cpu_busy"],
                }
            )
        result: dict[str, Any] = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": " ".join([sys.executable, *sys.argv]),
            "machine": {
                "device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
            },
            "engine": {**engine_args, "dtype": str(engine.dtype)},
            "api_server_count": args.api_server_count,
            "client_workers": args.client_workers,
            "output_len": args.output_len,
            "idle": idle,
            "rows": table,
        }
        Path(args.output_json).write_text(json.dumps(result, indent=1))
        for row in table:
            print(
                f"C={row['concurrency']}: offline {row['offline_tok_s']:.1f} tok/s, served {row['served_tok_s']:.1f}, "
                f"ratio {row['ratio']:.2f}x"
            )
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
