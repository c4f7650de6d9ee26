"""`dspark bench load`: hold a running server under concurrent streaming load, with clients hanging up mid-stream,
then check that nothing was lost or left behind.

Each prompt of a small fixed set is first sent alone, greedy, to the same server: that stream is its reference. Then,
for each of --rounds rounds, --concurrency clients each send request after request (a random prompt, T = 0) until
--duration has passed; a --disconnect-fraction of the requests hang up after a random number of text chunks (fewer
than the reference has, so most are cut mid-stream). Afterwards:
- every request that completed must have the reference's text and completion token count (and, when the requests ask
  for logprobs, its stream must list exactly that many tokens: none duplicated or lost between chunks);
- no request may fail (an HTTP error, an error event, a stream cut by the server);
- /metrics must show no request running or waiting and no KV block in use, within --settle seconds;
- the prompts sent alone once more must still give the references (the server outlived its clients);
- with --server-pid, the server's RSS after the last round must be within --rss-tolerance-mb of its RSS after the
  first (the first round warms allocators and caches, so growth during it is not counted as a leak).
A client hanging up after the last text chunk but before `[DONE]` may find its request already finished, so the
server's abort count can be below the client's disconnect count.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from dspark.bench.client import (
    Endpoint,
    RequestInput,
    RequestResult,
    fetch_metrics,
    open_session,
    send_request,
)
from dspark.bench.spec_metrics import parse_samples, spec_decode_counters, spec_decode_stats
from dspark.errors import ConfigError, DSparkError

# Plain continuations (completions, no chat template) with outputs of several lengths: SmolLM2-135M-Instruct stops after
# 7 to 30 tokens on some and runs to 64 on the others.
PROMPTS = (
    "The capital of France is",
    "Here is a short poem about the sea:",
    "The first five prime numbers are 2, 3, 5,",
    "Once upon a time, in a small village by the river,",
    "def fibonacci(n):",
    "Explain what a hash table is in one paragraph.",
    "Translate to French: Good morning, how are you today?",
    "The three laws of motion are",
)
# /metrics series read before and after (counters) or polled (gauges); `dspark:` names, as dspark serve exports them.
RUNNING, WAITING, KV_USAGE = "dspark:num_requests_running", "dspark:num_requests_waiting", "dspark:kv_cache_usage_perc"
ABORTED, PREEMPTIONS = "dspark:num_requests_aborted_total", "dspark:num_preemptions_total"
NUM_EXAMPLES = 5  # mismatches and errors quoted in the summary


@dataclass(frozen=True)
class LoadSettings:
    concurrency: int = 64
    duration: float = 60.0  # seconds per round in which new requests start
    disconnect_fraction: float = 0.2
    max_tokens: int = 64
    rounds: int = 2
    seed: int = 0
    settle: float = 10.0  # seconds to wait for /metrics to show the server idle after a round
    rss_tolerance_mb: float = 64.0
    logprobs: bool = False  # ask for logprobs=0, so every chunk lists its tokens and the stream's tokens are counted
    server_pid: int | None = None

    def __post_init__(self) -> None:
        for name in ("concurrency", "max_tokens", "rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "a positive integer")
        if not 0.0 <= self.disconnect_fraction <= 1.0:
            raise ConfigError("disconnect_fraction", self.disconnect_fraction, "a fraction in [0, 1]")
        for name in ("duration", "settle", "rss_tolerance_mb"):
            if not getattr(self, name) >= 0.0:
                raise ConfigError(name, getattr(self, name), "a number >= 0")
        if self.server_pid is not None and not Path(f"/proc/{self.server_pid}/status").exists():
            raise ConfigError("server_pid", self.server_pid, "the pid of a running process on this machine")


@dataclass
class Outcome:
    prompt: int  # index into the prompts
    cut_after: int | None  # text chunks after which the client was to hang up (None: never)
    result: RequestResult


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of the process in MiB (VmRSS of /proc/<pid>/status), or None without a pid."""
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise DSparkError(f"/proc/{pid}/status has no VmRSS line")


def metric_values(text: str | None) -> dict[str, float]:
    """The unlabelled samples and request_success_total by reason, summed over label sets, from a /metrics text."""
    values: dict[str, float] = {}
    for name, _, value in parse_samples(text or ""):
        values[name] = values.get(name, 0.0) + value
    return values


def check_outcome(outcome: Outcome, ref: RequestResult, logprobs: bool) -> str | None:
    """Why a completed request does not match its reference, or None when it does."""
    r = outcome.result
    if r.text != ref.text:
        return f"text differs from the reference at char {_first_difference(r.text, ref.text)}"
    if r.output_tokens != ref.output_tokens:
        return f"usage says {r.output_tokens} completion tokens, the reference {ref.output_tokens}"
    if logprobs and r.num_logprob_tokens != r.output_tokens:
        return f"the stream listed {r.num_logprob_tokens} tokens, usage {r.output_tokens}"
    return None


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds, dtype=float) * 1000.0
    return {f"p{p}": float(np.percentile(ms, p)) if ms.size else 0.0 for p in (50, 99)}


async def references(endpoint: Endpoint, inputs: list[RequestInput]) -> list[RequestResult]:
    """Each prompt alone, one after another, on fresh connections.

    Not on the load's pool: after a round and the wait for the server to go idle, its kept-alive connections may have
    outlived the server's keep-alive timeout, and reusing one fails as "Server disconnected"."""
    async with open_session(1) as session:
        refs = [await send_request(session, endpoint, req) for req in inputs]
    for i, ref in enumerate(refs):
        if not ref.success:
            raise DSparkError(f"the reference request for prompt {i} failed: {ref.error}")
    return refs


async def run_round(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    inputs: list[RequestInput],
    refs: list[RequestResult],
    settings: LoadSettings,
    rng: random.Random,
    progress: bool = True,
) -> tuple[list[Outcome], int]:
    """Keep settings.concurrency requests in flight for settings.duration seconds; the outcomes in start order and the
    most requests the server held at once (running + waiting, polled from /metrics every second)."""
    deadline = time.perf_counter() + settings.duration
    outcomes: list[Outcome] = []
    bar = tqdm(desc="bench load", unit="req", file=sys.stderr, disable=not progress)

    async def client() -> None:
        while time.perf_counter() < deadline:
            i = rng.randrange(len(inputs))
            # A cut point the reference reaches (0: before any text), so a cut request is cut mid-stream.
            cut = (
                rng.randrange(max(1, refs[i].num_text_chunks)) if rng.random() < settings.disconnect_fraction else None
            )
            outcome = Outcome(i, cut, RequestResult())
            outcomes.append(outcome)
            outcome.result = await send_request(session, endpoint, inputs[i], cut)
            bar.update(1)

    clients = asyncio.gather(*(client() for _ in range(settings.concurrency)))
    peak = 0
    while not clients.done():
        values = metric_values(await fetch_metrics(session, endpoint.base_url, endpoint.api_key))
        peak = max(peak, int(values.get(RUNNING, 0) + values.get(WAITING, 0)))
        await asyncio.wait([clients], timeout=1.0)
    await clients
    bar.close()
    return outcomes, peak


async def settle(session: aiohttp.ClientSession, endpoint: Endpoint, seconds: float) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV block is in use, for at most `seconds`; the last
    reading, with how long it took."""
    start = time.perf_counter()
    while True:
        values = metric_values(await fetch_metrics(session, endpoint.base_url, endpoint.api_key))
        reading = {"running": values.get(RUNNING, -1.0), "waiting": values.get(WAITING, -1.0)}
        reading["kv_cache_usage_perc"] = values.get(KV_USAGE, -1.0)  # -1: the server does not export it
        idle = all(v == 0 for v in reading.values())
        if idle or time.perf_counter() - start >= seconds:
            return {**reading, "idle": float(idle), "seconds": time.perf_counter() - start}
        await asyncio.sleep(0.2)


def round_summary(
    outcomes: list[Outcome], refs: list[RequestResult], settings: LoadSettings, duration: float
) -> dict[str, Any]:
    completed = [o for o in outcomes if o.result.success]
    mismatches = [(o, why) for o in completed if (why := check_outcome(o, refs[o.prompt], settings.logprobs))]
    failed = [o for o in outcomes if not o.result.success and not o.result.disconnected]
    return {
        "duration_s": duration,
        "requests": len(outcomes),
        "completed": len(completed),
        "disconnected": sum(o.result.disconnected for o in outcomes),
        "failed": len(failed),
        "mismatched": len(mismatches),
        "output_tokens": sum(o.result.output_tokens for o in completed),
        "latency_ms": percentiles_ms([o.result.latency for o in completed]),
        "ttft_ms": percentiles_ms([o.result.ttft for o in completed]),
        "mismatch_examples": [
            {"prompt": o.prompt, "why": why, "got": o.result.text, "expected": refs[o.prompt].text}
            for o, why in mismatches[:NUM_EXAMPLES]
        ],
        "error_examples": [o.result.error for o in failed[:NUM_EXAMPLES]],
    }


async def run_load(
    endpoint: Endpoint, settings: LoadSettings, prompts: tuple[str, ...] = PROMPTS, progress: bool = True
) -> dict[str, Any]:
    """The whole run: references, the rounds with their checks, the references again; the summary (see the module
    docstring), with `ok` false and `problems` saying why when anything mismatched, failed or leaked."""
    extra = {"logprobs": 0} if settings.logprobs else {}
    inputs = [RequestInput(p, settings.max_tokens, 0.0, extra=dict(extra)) for p in prompts]
    rng = random.Random(settings.seed)
    rounds: list[dict[str, Any]] = []
    refs = await references(endpoint, inputs)
    async with open_session(1) as session:
        before = await fetch_metrics(session, endpoint.base_url, endpoint.api_key)
    for k in range(settings.rounds):
        # A fresh pool per round: connections kept alive through the previous round's idle wait outlive the
        # server's keep-alive timeout, and reusing one can fail as "Server disconnected". Two connections beyond
        # the clients, so /metrics polls never queue behind the load.
        async with open_session(settings.concurrency + 2) as session:
            start_text = await fetch_metrics(session, endpoint.base_url, endpoint.api_key)
            rss_before = rss_mib(settings.server_pid)
            start = time.perf_counter()
            outcomes, peak = await run_round(session, endpoint, inputs, refs, settings, rng, progress)
            summary = round_summary(outcomes, refs, settings, time.perf_counter() - start)
            summary["after"] = await settle(session, endpoint, settings.settle)
            end_text = await fetch_metrics(session, endpoint.base_url, endpoint.api_key)
        start_m, end_m = metric_values(start_text), metric_values(end_text)
        rounds.append(
            {
                "round": k,
                **summary,
                "peak_server_requests": peak,
                "server_aborts": end_m.get(ABORTED, 0.0) - start_m.get(ABORTED, 0.0),
                "preemptions": end_m.get(PREEMPTIONS, 0.0) - start_m.get(PREEMPTIONS, 0.0),
                "rss_before_mib": rss_before,
                "rss_after_mib": rss_mib(settings.server_pid),
            }
        )
    again = await references(endpoint, inputs)
    async with open_session(1) as session:
        after = await fetch_metrics(session, endpoint.base_url, endpoint.api_key)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "base_url": endpoint.base_url,
        "backend": endpoint.backend,
        "model_id": endpoint.model,
        "settings": asdict(settings),
        "prompts": list(prompts),
        "references": [
            {"text": r.text, "output_tokens": r.output_tokens, "finish_reason": r.finish_reason} for r in refs
        ],
        "references_unchanged_after": [
            a.text == r.text and a.output_tokens == r.output_tokens for a, r in zip(again, refs, strict=True)
        ],
        "rounds": rounds,
        **totals(rounds),
        **spec_decode_stats(spec_decode_counters(before), spec_decode_counters(after)),
    }
    result["problems"] = problems(result, settings)
    result["ok"] = not result["problems"]
    return result


def totals(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("requests", "completed", "disconnected", "failed", "mismatched", "server_aborts", "preemptions")
    out: dict[str, Any] = {key: sum(r[key] for r in rounds) for key in keys}
    out["requests_held"] = max(r["peak_server_requests"] for r in rounds)  # most the server had at once
    out["p99_latency_ms"] = max(r["latency_ms"]["p99"] for r in rounds)  # the worst round's
    return out


def problems(result: dict[str, Any], settings: LoadSettings) -> list[str]:
    found = []
    if result["mismatched"]:
        found.append(f"{result['mismatched']} completed requests differ from their reference")
    if result["failed"]:
        found.append(f"{result['failed']} requests failed")
    if not all(result["references_unchanged_after"]):
        found.append("the prompts sent alone after the load no longer give the references")
    for r in result["rounds"]:
        if not r["after"]["idle"]:
            found.append(f"round {r['round']}: the server was not idle {settings.settle:g} s after it: {r['after']}")
    rss = [r["rss_after_mib"] for r in result["rounds"]]
    if len(rss) > 1 and rss[0] is not None and rss[-1] - rss[0] > settings.rss_tolerance_mb:
        found.append(f"RSS grew {rss[-1] - rss[0]:.0f} MiB from the first round's end to the last's")
    return found


def summary_line(result: dict[str, Any]) -> str:
    rss = [r["rss_after_mib"] for r in result["rounds"]]
    rss_text = f", RSS after each round {' / '.join(f'{m:.0f}' for m in rss)} MiB" if rss[0] is not None else ""
    verdict = "OK" if result["ok"] else "FAILED: " + "; ".join(result["problems"])
    return (
        f"{result['requests']} requests ({result['completed']} completed, {result['disconnected']} disconnected, "
        f"{result['failed']} failed, {result['mismatched']} mismatched), {result['requests_held']} held at once, "
        f"p99 latency {result['p99_latency_ms']:.0f} ms{rss_text}: {verdict}"
    )
