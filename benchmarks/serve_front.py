"""The server's front alone, at GPU rates, on any machine: `dspark serve`'s app and ProcessEngine over a stub core
process that emits one text token per request every --step-ms (a C = 256 H200 decode step is ~2 ms), loaded by
`dspark bench serve`'s client. What the front (and the client) sustain against the stub's ideal rate, C / step_ms,
says how far the front is from keeping up with the engine; --profile writes the front's cProfile.

    python benchmarks/serve_front.py --concurrency 256 --step-ms 2 --output-len 256 --profile front.prof
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import zmq

from dspark.engine.core_proc import CoreLoop, Ready, output_encoder
from dspark.engine.messages import EngineCoreInfo, EngineCoreOutput, EngineCoreRequest


class StubCore:
    """EngineCore's interface, no model: every request gets a token a step until its max_tokens."""

    def __init__(self, step_ms: float) -> None:
        self.step_s = step_ms / 1e3
        self.requests: dict[str, list[Any]] = {}
        self.info = EngineCoreInfo(49152, 8192, 2, 0, "stub", "none")

    def add_request(self, request: EngineCoreRequest) -> None:
        self.requests[request.request_id] = [request.sampling_params.max_tokens, 0]

    def abort_requests(self, ids: list[str]) -> None:
        for rid in ids:
            self.requests.pop(rid, None)

    def stop_requests(self, stops: list[tuple[str, int]]) -> None:
        self.abort_requests([rid for rid, _ in stops])

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[EngineCoreOutput]:
        time.sleep(self.step_s)
        now, outs = time.monotonic(), []
        for rid, state in list(self.requests.items()):
            state[1] += 1
            token = 1000 + (state[1] * 7919 + len(rid)) % 20000  # ordinary text tokens
            done = state[1] >= state[0]
            outs.append(EngineCoreOutput(rid, [token], finish_reason="length" if done else None, first_token_time=now))
            if done:
                del self.requests[rid]
        return outs

    def end_step(self) -> None:
        pass

    def get_metrics(self) -> dict[str, Any]:
        return {"num_requests_running": len(self.requests)}


def run_stub_core(config: Any, input_address: str, output_address: str, front_pid: int, step_ms: float = 2.0) -> None:
    ctx = zmq.Context()
    inputs, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inputs.connect(input_address)
    outputs.connect(output_address)
    core = StubCore(float(os.environ.get("STUB_STEP_MS", step_ms)))
    outputs.send(output_encoder.encode(Ready(core.info, os.getpid())))
    CoreLoop(core, inputs, outputs).run()


def serve(port: int, profile: str | None) -> None:
    import uvicorn

    from dspark.config import EngineConfig
    from dspark.server.app import build_app
    from dspark.server.process_engine import ProcessEngine

    engine = ProcessEngine(EngineConfig(), core_target=run_stub_core)
    app = build_app(engine, ["stub"])
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    try:
        server.run()
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=0, help="default: 2 x concurrency")
    ap.add_argument("--port", type=int, default=8177)
    ap.add_argument("--profile", help="write the front's cProfile here")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.port, args.profile)
        return 0

    from dspark.bench.client import Endpoint
    from dspark.bench.serve import run_benchmark
    from dspark.bench.serve_data import ServePrompt

    cmd = [sys.executable, __file__, "--serve", "--port", str(args.port)]
    cmd += ["--profile", args.profile] if args.profile else []
    server = subprocess.Popen(cmd, env={**os.environ, "STUB_STEP_MS": str(args.step_ms)})
    url = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        endpoint = Endpoint(url, "openai", "/v1/completions", "stub")
        n = args.num_prompts or 2 * args.concurrency
        prompts = [ServePrompt(f"question {i}: what is {i} + {i}?", None, args.output_len) for i in range(n)]
        result = asyncio.run(
            run_benchmark(endpoint, prompts, ignore_eos=True, max_concurrency=args.concurrency, progress=False)
        )
        ideal = args.concurrency / (args.step_ms / 1e3)
        summary = {
            "concurrency": args.concurrency,
            "step_ms": args.step_ms,
            "output_throughput": result["output_throughput"],
            "ideal": ideal,
            "fraction": result["output_throughput"] / ideal,
            "median_tpot_ms": result["median_tpot_ms"],
            "median_ttft_ms": result["median_ttft_ms"],
            "failed": result["failed"],
            "chunks_per_request": sum(len(i) + 1 for i in result["itls"]) / max(1, len(result["itls"])),
        }
        print(json.dumps(summary, indent=1))
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
