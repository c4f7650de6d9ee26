"""GSM8K through `dspark serve` with no speculation, fixed k and adaptive verification: the same accuracy, and at
temperature 0 the same completions, question by question.

    python benchmarks/gsm8k_arms.py --data-dir ../shared/data --num-questions 200 --output-json gsm8k-arms.json

Each arm gets its own server process (the default model unless --model) on a free port; `dspark eval gsm8k` runs
against it with --save-detailed, and the completions are compared with the no-speculation arm's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ARMS: dict[str, dict[str, Any] | None] = {
    "no-spec": None,
    "fixed-3": {"method": "dspark", "num_speculative_tokens": 3, "enable_adaptive_verification": False},
    "fixed-7": {"method": "dspark", "num_speculative_tokens": 7, "enable_adaptive_verification": False},
    "adaptive": {"method": "dspark", "num_speculative_tokens": 7},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server at {url} was not healthy within {timeout:.0f} s")


def run_arm(name: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "dspark", "serve", args.model, "--port", str(port), "--device", args.device]
    cmd += ["--max-num-seqs", str(args.max_concurrency), "--log-level", "warning"]
    if ARMS[name] is not None:
        cmd += ["--speculative-config", json.dumps(ARMS[name])]
    with open(out_dir / f"serve-{name}.log", "wb") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, server, args.startup_timeout)
            result = out_dir / f"gsm8k-{name}.json"
            data = Path(args.data_dir) / "gsm8k"
            evaluate = [sys.executable, "-m", "dspark", "eval", "gsm8k", "--base-url", url, "--save-detailed"]
            evaluate += ["--data-path", str(data / "test.jsonl"), "--train-path", str(data / "train.jsonl.gz")]
            evaluate += ["--num-shots", str(args.num_shots), "--num-questions", str(args.num_questions)]
            evaluate += ["--max-concurrency", str(args.max_concurrency), "--output-json", str(result)]
            subprocess.run(
                evaluate,
                check=True,
            )
            return json.loads(result.read_text())
        finally:
            server.terminate()
            server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--num-questions", type=int, default=200)
    parser.add_argument("--num-shots", type=int, default=5)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--arm", action="append", choices=list(ARMS), help="(default: all)")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    arms = args.arm or list(ARMS)
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gsm8k-arms-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {name: run_arm(name, args, out_dir) for name in arms}
    base = results[arms[0]]["questions"]
    rows = []
    for name, res in results.items():
        texts = [q["completion"] for q in res["questions"]]
        same = sum(a == b["completion"] for a, b in zip(texts, base, strict=True))
        row = {
            "arm": name,
            "accuracy": res["accuracy"],
            "invalid": res["invalid"],
            "failed": res.get("failed", 0),
            "num_questions": len(texts),
            f"identical_to_{arms[0]}": same,
            "output_throughput": res.get("output_throughput"),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.output_json:
        summary = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "rows": rows}
        Path(args.output_json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
