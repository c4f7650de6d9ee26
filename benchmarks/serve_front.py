"""The server's front alone, at GPU rates, on any machine: `dspark serve`'s app and ProcessEngine over a stub core
process that emits one text token per request every --step-ms (a C = 256 H200 decode step is ~2 ms), loaded by
`dspark bench serve`'s client. What the front (and the client) sustain against the stub's ideal rate, C / step_ms,
says how far the front is from keeping up with the engine; --profile writes the front's cProfile.

    python benchmarks/serve_front.py --concurrency 256 --step-ms 2 --output-len 256 --profile front.prof
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import resource
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from dspark.engine.core_proc import run_core
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


def make_stub_core(config: Any) -> StubCore:
    return StubCore(float(os.environ["STUB_STEP_MS"]))


# engine/core_proc.py's entry point, building the stub instead of an EngineCore (picklable: spawn starts it)
run_stub_core = functools.partial(run_core, make_core=make_stub_core)


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # it has exited
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_cpu() -> float:
    """This process's CPU seconds and its reaped children's (client workers; the server is reaped only at the end)."""
    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime


def _tree(pid: int) -> list[int]:
    """pid and its descendants."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    children = [int(p) for p in path.read_text().split()] if path.exists() else []
    return [pid, *(d for c in children for d in _tree(c))]


def _role(pid: int, server_pid: int) -> str:
    if pid == server_pid:
        return "server"
    try:
        return f"{Path(f'/proc/{pid}/comm').read_text().strip()}:{pid}"
    except OSError:
        return f"pid:{pid}"


def serve(port: int, profile: str | None, api_server_count: int) -> None:
    from dspark.config import EngineConfig
    from dspark.server.api_servers import bind, serve_many, serve_on
    from dspark.server.process_engine import ProcessEngine

    socks = bind("127.0.0.1", port, api_server_count)
    if api_server_count > 1:  # the launcher, as `dspark serve --api-server-count N` (no profile: N processes)
        serve_many(EngineConfig(), api_server_count, ["stub"], None, 16 << 20, "warning", socks, run_stub_core)
        return
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    try:
        engine = ProcessEngine(EngineConfig(), core_target=run_stub_core)
        serve_on(engine, ["stub"], None, 16 << 20, "warning", socks[0])
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
    ap.add_argument("--client-workers", type=int, default=1, help="client processes (bench serve --num-workers)")
    ap.add_argument("--api-server-count", type=int, default=1, help="API server processes on the one stub core")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.port, args.profile, args.api_server_count)
        return 0

    from dspark.bench.client import Endpoint, run_async
    from dspark.bench.serve import run_benchmark
    from dspark.bench.serve_data import ServePrompt

    cmd = [sys.executable, __file__, "--serve", "--port", str(args.port)]
    cmd += ["--profile", args.profile] if args.profile else []
    cmd += ["--api-server-count", str(args.api_server_count)]
    server = subprocess.Popen(cmd, env={**os.environ, "STUB_STEP_MS": str(args.step_ms)})
    url = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):  # TimeoutError: a front not up yet
                time.sleep(0.2)
        endpoint = Endpoint(url, "openai", "/v1/completions", "stub")
        n = args.num_prompts or 2 * args.concurrency
        prompts = [ServePrompt(f"question {i}: what is {i} + {i}?", None, args.output_len) for i in range(n)]
        pids = _tree(server.pid)
        before = {pid: _cpu_seconds(pid) for pid in pids}
        client_before = _client_cpu()
        result = run_async(
            run_benchmark(
                endpoint,
                prompts,
                ignore_eos=True,
                max_concurrency=args.concurrency,
                progress=False,
                num_workers=args.client_workers,
            )
        )
        client_cpu = _client_cpu() - client_before
        server_cpu = {pid: _cpu_seconds(pid) - b for pid, b in before.items()}
        ideal = args.concurrency / (args.step_ms / 1e3)
        summary = {
            "concurrency": args.concurrency,
            "client_workers": args.client_workers,
            "api_server_count": args.api_server_count,
            "step_ms": args.step_ms,
            "output_throughput": result["output_throughput"],
            "ideal": ideal,
            "fraction": result["output_throughput"] / ideal,
            "median_tpot_ms": result["median_tpot_ms"],
            "median_ttft_ms": result["median_ttft_ms"],
            "failed": result["failed"],
            "first_errors": sorted({e for e in result["errors"] if e})[:3],
            "chunks_per_request": sum(len(i) + 1 for i in result["itls"]) / max(1, len(result["itls"])),
            # CPU microseconds per output token: which process would saturate first on a machine with cores to spare
            "cpu_us_per_token": {
                "client": 1e6 * client_cpu / max(1, result["total_output_tokens"]),
                **{
                    _role(pid, server.pid): 1e6 * cpu / max(1, result["total_output_tokens"])
                    for pid, cpu in server_cpu.items()
                },
            },
        }
        print(json.dumps(summary, indent=1))
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
