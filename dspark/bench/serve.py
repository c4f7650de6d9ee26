"""`dspark bench serve`: load an OpenAI-compatible server over HTTP and report latency and throughput as vLLM does.

The client mirrors `vllm bench serve` for the flags users reach for and writes the same result JSON keys, so results
from the two compare side by side. Requests stream (client.py says what is measured and how); they arrive all at once
or as a Poisson process of --request-rate per second (drawn from --seed), and at most --max-concurrency are in flight.
Per request: TTFT, ITL (per chunk), TPOT = (E2E - TTFT) / (output tokens - 1) for requests with more than one token,
E2E. Totals count successful requests only; failed ones are counted and their errors kept. The spec_decode_* fields
come from the server's /metrics counters before and after the run (spec_metrics.py) and are absent when the server did
not draft.
"""

from __future__ import annotations

import asyncio
import math
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from dspark.bench.client import (
    Endpoint,
    RequestInput,
    RequestResult,
    fetch_metrics,
    open_session,
    run_in_workers,
    run_requests,
)
from dspark.bench.serve_data import ServePrompt
from dspark.bench.spec_metrics import spec_decode_counters, spec_decode_stats

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)
DETAILED_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


def request_inputs(prompts: list[ServePrompt], temperature: float, ignore_eos: bool) -> list[RequestInput]:
    extra = {"ignore_eos": True} if ignore_eos else {}
    return [RequestInput(p.text, p.output_len, temperature, p.prompt_len, dict(extra)) for p in prompts]


def benchmark_metrics(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Counts, throughputs and the latency statistics (in ms) of a run, under vLLM's keys."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    for name in LATENCY_METRICS:
        ms = np.asarray(samples[name], dtype=float) * 1000.0
        empty = ms.size == 0  # every request failed, or none wrote two tokens: report zeros, as vLLM does
        out[f"mean_{name}_ms"] = 0.0 if empty else float(ms.mean())
        out[f"median_{name}_ms"] = 0.0 if empty else float(np.median(ms))
        out[f"std_{name}_ms"] = 0.0 if empty else float(ms.std())
        for p in PERCENTILES:
            out[f"p{p}_{name}_ms"] = 0.0 if empty else float(np.percentile(ms, p))
    return out


async def run_benchmark(
    endpoint: Endpoint,
    prompts: list[ServePrompt],
    *,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
    num_warmups: int = 0,
    progress: bool = True,
    num_workers: int = 1,
) -> dict[str, Any]:
    """Run the prompts against the server; the result JSON with the per-request lists (DETAILED_FIELDS) included.
    num_workers > 1 spreads the requests over that many client processes (client.run_in_workers)."""
    inputs = request_inputs(prompts, temperature, ignore_eos)
    async with open_session(max_concurrency) as session:
        if num_warmups > 0:
            warm = [inputs[i % len(inputs)] for i in range(num_warmups)]
            await run_requests(session, endpoint, warm, max_concurrency=max_concurrency, desc="warmup", progress=False)
        before = spec_decode_counters(await fetch_metrics(session, endpoint.base_url, endpoint.api_key))
        load: dict[str, Any] = {
            "max_concurrency": max_concurrency,
            "request_rate": request_rate,
            "seed": seed,
            "desc": "bench serve",
            "progress": progress,
        }
        if num_workers > 1:
            run = await asyncio.to_thread(lambda: run_in_workers(endpoint, inputs, num_workers, **load))
        else:
            run = await run_requests(session, endpoint, inputs, **load)
        after = spec_decode_counters(await fetch_metrics(session, endpoint.base_url, endpoint.api_key))
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": endpoint.backend,
        "endpoint": endpoint.path,
        "base_url": endpoint.base_url,
        "model_id": endpoint.model,
        "num_prompts": len(prompts),
        "max_concurrency": max_concurrency,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",  # JSON has no infinity
        "max_concurrent_requests": run.max_in_flight,
        "num_client_workers": num_workers,
        "client_cpu_s": run.cpu_s,  # the client's own CPU over the run: a client near 1 s/s per worker is the limit
        **benchmark_metrics(run.results, run.duration),
        **spec_decode_stats(before, after),
        "input_lens": [r.prompt_tokens for r in run.results],
        "output_lens": [r.output_tokens for r in run.results],
        "ttfts": [r.ttft for r in run.results],
        "itls": [r.itl for r in run.results],
        "generated_texts": [r.text for r in run.results],
        "errors": [r.error for r in run.results],
    }
    return result


def summary_table(result: dict[str, Any]) -> str:
    """The end-of-run table, laid out as vLLM's so the two read alike."""
    rows: list[str] = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        rows.append(f"{label:<40} {format(value, fmt):<10}")

    def section(title: str) -> None:
        rows.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result["max_concurrency"] is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    if result["request_rate"] != "inf":
        row("Request rate configured (RPS):", result["request_rate"], ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    titles = {
        "ttft": ("Time to First Token", "TTFT"),
        "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
        "itl": ("Inter-token Latency", "ITL"),
        "e2el": ("End-to-end Latency", "E2EL"),
    }
    for name, (title, short) in titles.items():
        section(title)
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", result[f"median_{name}_ms"], ".2f")
        row(f"P99 {short} (ms):", result[f"p99_{name}_ms"], ".2f")
    if "spec_decode_num_drafts" in result:
        section("Speculative Decoding")
        row("Acceptance rate (%):", result["spec_decode_acceptance_rate"], ".2f")
        row("Acceptance length:", result["spec_decode_acceptance_length"], ".2f")
        row("Drafts:", result["spec_decode_num_drafts"])
        row("Draft tokens:", result["spec_decode_draft_tokens"])
        row("Accepted tokens:", result["spec_decode_accepted_tokens"])
        rows.append("Per-position acceptance rate (%):")
        for i, rate in enumerate(result["spec_decode_per_position_acceptance_rates"]):
            row(f"  Position {i}:", 100.0 * rate, ".2f")
    rows.append("=" * 50)
    first_error = next((e for e in result.get("errors", []) if e), None)
    if first_error:
        rows.append(f"first error: {first_error}")
    return "\n".join(rows)


def default_result_filename(result: dict[str, Any]) -> str:
    concurrency = f"-concurrency{result['max_concurrency']}" if result["max_concurrency"] is not None else ""
    model = Path(result["model_id"]).name or "model"
    return f"{result['backend']}-{result['request_rate']}qps{concurrency}-{model}-{result['date']}.json"
