"""/metrics: Prometheus text under vLLM's names with the `dspark:` prefix.

Two sources. The engine's own counters and gauges (requests running and waiting, KV-cache usage, tokens, the
spec-decode counters and the adaptive-verification metrics of speculative/planner.py) are read at scrape time from the
snapshot the engine thread takes after every step, by a custom collector: nothing here ever touches the engine.
Per-request histograms (TTFT, end-to-end latency, time per output token) and the finished-request counter are observed
by the handlers when a request ends. Each server has its own CollectorRegistry, so a process can hold several apps
(the tests do).

Engine metrics this file does not know by name still appear, as gauges named `dspark:<key>`, so a metric the planner
gains later is exported without an edit here.

With several API servers (`--api-server-count`), each counts the requests it served. Each writes its counts (and
histograms, kept as plain counts for this) to a file of its own, at most every PUBLISH_EVERY_S and only when they
changed; the server a scrape reaches adds the others' files to its own live counts. So the totals are those of the
whole server, with the other API servers' part at most PUBLISH_EVERY_S old.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from dspark.outputs import RequestOutput
from dspark.server.async_engine import AsyncEngine
from dspark.server.process_engine import ProcessEngine

logger = logging.getLogger("dspark.server")

PREFIX = "dspark:"
PUBLISH_EVERY_S = 0.1
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# get_metrics() key -> (name, help). Counters get `_total` appended by the exposition.
COUNTERS = {
    "num_prompt_tokens": ("prompt_tokens", "Prompt tokens added to the engine."),
    "num_generation_tokens": (
        "generation_tokens",
        "Tokens generated (aborted requests' included; none past the stop string that ended a request).",
    ),
    "num_requests_finished": ("num_requests_finished", "Requests that ended by stop or length."),
    "num_requests_aborted": ("num_requests_aborted", "Requests aborted (client gone, engine failure, refused adds)."),
    "num_requests_failed": ("num_requests_failed", "Requests the engine failed alone (finish_reason error)."),
    "num_preemptions": ("num_preemptions", "Requests preempted to free KV-cache blocks."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens served by the prefix cache."),
    "num_steps": ("engine_steps", "Engine steps run."),
    "num_pipelined_steps": (
        "engine_pipelined_steps",
        "Steps launched before the previous step's tokens reached the host (async scheduling).",
    ),
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "Request-steps that verified drafts (vLLM's count)."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens verified."),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    "spec_decode_plan_ms_total": ("spec_decode_plan_ms", "Milliseconds spent planning adaptive verification."),
    "spec_decode_num_steps_without_drafting": (
        "spec_decode_num_steps_without_drafting",
        "Steps where adaptive verification skipped drafting (it would not have paid).",
    ),
    "spec_decode_regime_explorations": (
        "spec_decode_regime_explorations",
        "Bursts spent measuring the regime (drafting or not) that adaptive verification was not following.",
    ),
    "spec_decode_predicted_accepted_tokens": (
        "spec_decode_predicted_accepted_tokens",
        "Accepted drafts the survivals predicted, over the drafts verified.",
    ),
    "spec_decode_realised_accepted_tokens": (
        "spec_decode_realised_accepted_tokens",
        "Accepted drafts, over the same drafts as the prediction.",
    ),
}
GAUGES = {
    "num_requests_running": ("num_requests_running", "Requests in the running batch."),
    "num_requests_waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full), as vLLM's."),
    "kv_num_blocks": ("kv_cache_num_blocks", "KV-cache blocks."),
    "kv_num_used_blocks": ("kv_cache_num_used_blocks", "KV-cache blocks in use."),
    "spec_decode_mean_acceptance_length": (
        "spec_decode_mean_acceptance_length",
        "1 + accepted / drafts, since start.",
    ),
    "spec_decode_verify_budget_mean": (
        "spec_decode_verify_budget_mean",
        "Drafts adaptive verification chose to verify per planned step, mean since start.",
    ),
    "spec_decode_calibration_error": (
        "spec_decode_calibration_error",
        "Expected calibration error of the survivals of verified drafts.",
    ),
    "spec_decode_cost_model_error": (
        "spec_decode_cost_model_error",
        "(predicted - measured) / measured step time of the profiled cost curves, mean over steps.",
    ),
    "spec_decode_cost_model_abs_error": ("spec_decode_cost_model_abs_error", "As above, of its absolute value."),
    "spec_decode_refined_cost_model_error": (
        "spec_decode_refined_cost_model_error",
        "(predicted - measured) / measured step time with the online overhead term planning uses.",
    ),
    "spec_decode_refined_cost_model_abs_error": (
        "spec_decode_refined_cost_model_abs_error",
        "As above, of its absolute value.",
    ),
    "spec_decode_cost_model_overhead_ms": (
        "spec_decode_cost_model_overhead_ms",
        "Per-step overhead (ms) the online cost model adds to the profiled curves of a plain step (one request).",
    ),
    "spec_decode_cost_model_spec_overhead_ms": (
        "spec_decode_cost_model_spec_overhead_ms",
        "As above, of a speculative step (it verified drafts or drafted).",
    ),
}
# get_metrics() lists -> (name, label of the index, help)
LABELLED_COUNTERS = {
    "spec_decode_num_accepted_tokens_per_pos": (
        "spec_decode_num_accepted_tokens_per_pos",
        "position",
        "Drafts accepted at each position (0: the first draft).",
    ),
    "spec_decode_verify_len_hist": (
        "spec_decode_verify_len",
        "num_verified",
        "Request-steps that verified this many drafts (adaptive verification's choice).",
    ),
}

# Latency buckets in seconds: CPU steps take milliseconds to a second, GPU steps a fraction of a millisecond.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _Histogram:
    """A histogram as plain counts (per bucket, not cumulative) and a sum, so that several API servers' add up."""

    def __init__(self, name: str, text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.text, self.buckets = PREFIX + name, text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1  # the first bound >= value: `le` semantics
        self.sum += value

    def state(self) -> list[float]:
        return [*self.counts, self.sum]

    def family(self, state: list[float]) -> HistogramMetricFamily:
        cumulative = list(itertools.accumulate(state[:-1]))
        bounds = [floatToGoString(b) for b in self.buckets] + ["+Inf"]
        return HistogramMetricFamily(
            self.name, self.text, buckets=list(zip(bounds, cumulative, strict=True)), sum_value=state[-1]
        )


class FrontPeers:
    """The API servers' shared directory of counts: this one's file, and reading the others'. It also says when every
    API server is ready: each takes its own Ready from the core in its own time, and /health answers 200 only once
    all have, so that no request sent after a 200 lands on one still starting (SO_REUSEPORT picks any)."""

    def __init__(self, directory: str, index: int, count: int) -> None:
        self.dir, self.index, self.count = Path(directory), index, count
        self._published: dict[str, Any] | None = None
        self._all_ready = False  # once true, for good: an API server that dies stops them all (server/api_servers.py)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(dict[str, Any])

    def publish(self, state: dict[str, Any]) -> None:
        if state == self._published:
            return
        path = self.dir / f"front-{self.index}.msgpack"
        temporary = path.with_suffix(".tmp")
        temporary.write_bytes(self._encoder.encode(state))
        os.replace(temporary, path)  # atomic: a reader sees the old counts or the new ones, never half a file
        self._published = state

    def mark_ready(self) -> None:
        (self.dir / f"ready-{self.index}").touch()

    def num_ready(self) -> int:
        return sum((self.dir / f"ready-{i}").exists() for i in range(self.count))

    def all_ready(self) -> bool:
        if not self._all_ready:
            self._all_ready = self.num_ready() == self.count
        return self._all_ready

    def others(self) -> list[dict[str, Any]]:
        states = []
        for i in range(self.count):
            if i == self.index:
                continue
            try:
                states.append(self._decoder.decode((self.dir / f"front-{i}.msgpack").read_bytes()))
            except FileNotFoundError:  # it has counted nothing yet
                continue
            except (OSError, msgspec.DecodeError):
                logger.warning("cannot read API server %d's metrics; they are left out of this scrape", i)
        return states


class ServerMetrics:
    def __init__(self, engine: AsyncEngine | ProcessEngine, peers: FrontPeers | None = None) -> None:
        self.engine = engine
        self.peers = peers
        self.registry = CollectorRegistry()
        # Finished requests by reason, as handlers saw them finish; "abort" is the engine's own count (_EngineCollector)
        # so that request_success_total{finished_reason="abort"} and num_requests_aborted_total agree.
        self.finish_reasons: dict[str, int] = {}
        self.ttft = _Histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.e2e = _Histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.tpot = _Histogram(
            "time_per_output_token_seconds",
            "Per request: (finish - first token) / (output tokens - 1).",
            TPOT_BUCKETS,
        )
        self.queue_time = _Histogram("request_queue_time_seconds", "Arrival to first scheduled.", TTFT_BUCKETS)
        self.prompt_tokens = _Histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.generation_tokens = _Histogram("request_generation_tokens", "Output tokens per request.", TOKEN_BUCKETS)
        self.histograms = [self.ttft, self.e2e, self.tpot, self.queue_time, self.prompt_tokens, self.generation_tokens]
        self.registry.register(_EngineCollector(self))

    def finished(self, out: RequestOutput) -> None:
        """One finished request's latencies, from the engine's own timestamps."""
        m = out.metrics
        reason = out.outputs[0].finish_reason or "unknown"
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        self.prompt_tokens.observe(m.num_prompt_tokens)
        self.generation_tokens.observe(m.num_generation_tokens)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None and m.finished_time is not None and m.num_generation_tokens > 1:
            self.tpot.observe((m.finished_time - m.first_token_time) / (m.num_generation_tokens - 1))

    def front_state(self) -> dict[str, Any]:
        """What this API server counted: the part of the metrics that several API servers add up."""
        front_metrics = getattr(self.engine, "front_metrics", None)  # a ProcessEngine's (in-process: one front)
        front = front_metrics() if front_metrics is not None else {}
        return {
            "counters": front,
            "finish_reasons": dict(self.finish_reasons),
            "histograms": {h.name: h.state() for h in self.histograms},
        }

    def merged_state(self) -> dict[str, Any]:
        """This API server's counts, plus the others' when there are several."""
        state = self.front_state()
        if self.peers is None:
            return state
        self.peers.publish(state)  # the freshest counts for a scrape the others answer now
        for other in self.peers.others():
            for part in ("counters", "finish_reasons"):
                for key, value in other.get(part, {}).items():
                    state[part][key] = state[part].get(key, 0) + value
            for name, values in other.get("histograms", {}).items():
                mine = state["histograms"].get(name)
                if mine is not None and len(mine) == len(values):
                    state["histograms"][name] = [a + b for a, b in zip(mine, values, strict=True)]
        return state

    async def publish_forever(self) -> None:
        """With several API servers: keep this one's file current (run as a task for the server's life)."""
        assert self.peers is not None
        warned = False
        while True:
            try:
                self.peers.publish(self.front_state())
            except OSError as e:  # a full or vanished temporary directory: the others' scrapes miss this one's counts
                if not warned:
                    logger.warning(
                        "cannot share this API server's metrics (%s); other API servers' /metrics miss them", e
                    )
                    warned = True
            await asyncio.sleep(PUBLISH_EVERY_S)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.engine = metrics.engine
        self._highest: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}  # counter sample -> value exported

    def collect(self) -> Iterator[Metric]:
        # A Prometheus counter never goes down; the engine's counts can (the core in its own process takes back tokens
        # past a stop string after counting them), so each counter is exported as its highest value yet: tokens a
        # scrape saw before they were taken back stay counted until new ones make up for them.
        for family in self._families():
            if family.type == "counter":
                family.samples = [self._never_lower(sample) for sample in family.samples]
            yield family

    def _never_lower(self, sample: Sample) -> Sample:
        key = (sample.name, tuple(sorted(sample.labels.items())))
        value = max(sample.value, self._highest.get(key, sample.value))
        self._highest[key] = value
        return sample._replace(value=value)

    def _families(self) -> Iterator[Metric]:
        state = self.metrics.merged_state()
        snapshot = {**self.engine.metrics(), **state["counters"]}
        for histogram in self.metrics.histograms:
            yield histogram.family(state["histograms"][histogram.name])
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Requests finished, by finish reason (stop, length; abort: the client went away or the engine failed).",
            labels=["finished_reason"],
        )
        for reason, count in {**state["finish_reasons"], "abort": snapshot.get("num_requests_aborted", 0)}.items():
            success.add_metric([reason], count)
        yield success
        yield CounterMetricFamily(
            PREFIX + "engine_step_errors",
            "Engine steps that raised (their requests failed; the log has the tracebacks).",
            value=self.engine.num_step_errors,
        )
        yield GaugeMetricFamily(
            PREFIX + "engine_alive",
            "1 while the engine runs, 0 while it starts and once it has stopped.",
            value=self.engine.alive,
        )
        for key, value in snapshot.items():
            yield from _families(key, value)


def _families(key: str, value: Any) -> Iterator[Metric]:
    if key in COUNTERS:
        name, text = COUNTERS[key]
        yield CounterMetricFamily(PREFIX + name, text, value=value)
    elif key in LABELLED_COUNTERS:
        name, label, text = LABELLED_COUNTERS[key]
        family = CounterMetricFamily(PREFIX + name, text, labels=[label])
        for i, count in enumerate(value):
            family.add_metric([str(i)], count)
        yield family
    elif key == "adaptive_verification_mode":
        family = GaugeMetricFamily(
            PREFIX + "spec_decode_adaptive_verification_info", "Adaptive verification's mode (1).", labels=["mode"]
        )
        family.add_metric([str(value)], 1)
        yield family
    elif key == "spec_decode_regime_tokens_per_ms":  # {load level: {"spec" | "plain": tokens per ms}}
        family = GaugeMetricFamily(
            PREFIX + "spec_decode_regime_tokens_per_ms",
            "Measured tokens per ms of steady drafting (spec) and plain steps, per load level.",
            labels=["level", "regime"],
        )
        for level, rates in value.items():
            for regime, rate in rates.items():
                family.add_metric([str(level), str(regime)], rate)
        yield family
    elif key in GAUGES or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        name, text = GAUGES.get(key, (key, f"engine.get_metrics()[{key!r}]."))
        family = GaugeMetricFamily(PREFIX + name, text)
        if isinstance(value, (int, float)):
            family.add_metric([], value)
        yield family
