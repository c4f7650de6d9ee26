"""/metrics of a live server with n-gram speculation and adaptive verification: the named series are there and move
after requests; a client that disconnects (mid-stream, or while waiting for a whole response) aborts its request,
and the running requests and used KV blocks return to 0. A counter never goes down, even when the engine's does."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
from server_harness import MODEL_NAME, drained, live_server, make_engine, metric, scrape, wait_for

from dspark.engine.llm_engine import LLMEngine
from dspark.server.metrics import ServerMetrics
from helpers import hold_drafting

PROMPT = "one two three four five one two three four five one two three"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "enable_adaptive_verification": True}

# vLLM's sample names under the `dspark:` prefix, and the adaptive-verification metrics of speculative/planner.py.
SERIES = [
    "dspark:num_requests_running",
    "dspark:num_requests_waiting",
    "dspark:kv_cache_usage_perc",
    "dspark:prompt_tokens_total",
    "dspark:generation_tokens_total",
    "dspark:request_success_total",
    "dspark:time_to_first_token_seconds_bucket",
    "dspark:e2e_request_latency_seconds_bucket",
    "dspark:time_per_output_token_seconds_bucket",
    "dspark:spec_decode_num_drafts_total",
    "dspark:spec_decode_num_draft_tokens_total",
    "dspark:spec_decode_num_accepted_tokens_total",
    "dspark:spec_decode_num_accepted_tokens_per_pos_total",
    "dspark:spec_decode_verify_len_total",
    "dspark:spec_decode_verify_budget_mean",
    "dspark:spec_decode_num_steps_without_drafting_total",
    "dspark:spec_decode_predicted_accepted_tokens_total",
    "dspark:spec_decode_realised_accepted_tokens_total",
    "dspark:spec_decode_calibration_error",
    "dspark:spec_decode_cost_model_error",
    "dspark:spec_decode_adaptive_verification_info",
]


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[tuple[str, LLMEngine]]:
    engine = make_engine(tiny_llama, SPEC)
    # The series must move, whatever the regime measures: held to drafting. Left to its measured rates, which for a
    # tiny model on a loaded machine are noise, the regime may keep every step plain.
    hold_drafting(engine)
    with live_server(engine) as url:
        yield url, engine


def test_named_series_exist_and_move(server: tuple[str, LLMEngine]) -> None:
    url, engine = server
    before = scrape(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0, stream=True
    )
    assert sum(1 for _ in stream) > 1
    after = scrape(url)
    for name in SERIES:
        assert re.search(f"^{re.escape(name)}[{{ ]", after, re.MULTILINE), f"{name} missing"

    def delta(name: str, labels: str = "") -> float:
        return metric(after, name, labels) - metric(before, name, labels)

    assert delta("dspark:prompt_tokens_total") >= len(engine.tokenizer.encode(PROMPT)) + 1
    assert delta("dspark:generation_tokens_total") >= 17
    assert delta("dspark:request_success_total", 'finished_reason="length"') >= 1
    assert (
        delta("dspark:request_success_total", 'finished_reason="length"')
        + delta("dspark:request_success_total", 'finished_reason="stop"')
        == 2
    )
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"dspark:{histogram}_count") == 2
    assert delta("dspark:spec_decode_num_drafts_total") > 0
    assert delta("dspark:spec_decode_num_draft_tokens_total") >= delta("dspark:spec_decode_num_accepted_tokens_total")
    assert metric(after, "dspark:spec_decode_num_accepted_tokens_per_pos_total", 'position="0"') > 0
    assert metric(after, "dspark:spec_decode_adaptive_verification_info", 'mode="async"') == 1
    assert metric(after, "dspark:num_requests_running") == 0 and metric(after, "dspark:engine_alive") == 1


def _open_request(url: str, body: dict[str, Any]) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
    sock.sendall(head.encode() + b"\r\n\r\n" + data)
    return sock


LONG = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_blocks(server: tuple[str, LLMEngine], stream: bool) -> None:
    url = server[0]
    before = scrape(url)
    sock = _open_request(url, {**LONG, "stream": stream})
    if stream:
        received = b""
        while received.count(b"data: ") < 3:  # a few tokens have been streamed
            received += sock.recv(4096)
    else:
        wait_for(lambda: metric(scrape(url), "dspark:kv_cache_num_used_blocks") > 0, what="the request to run")
    sock.close()

    wait_for(lambda: drained(url), what="running requests and used blocks to return to 0")
    after = scrape(url)
    assert metric(after, "dspark:kv_cache_usage_perc") == 0 and metric(after, "dspark:num_requests_waiting") == 0
    aborted = 'finished_reason="abort"'
    assert (
        metric(after, "dspark:request_success_total", aborted) - metric(before, "dspark:request_success_total", aborted)
        == 1
    )
    generated = metric(after, "dspark:generation_tokens_total") - metric(before, "dspark:generation_tokens_total")
    assert 0 < generated < LONG["max_tokens"], "the request ran to its end: it was never aborted"


def test_a_counter_never_goes_down_when_the_engine_takes_tokens_back() -> None:
    """The core in its own process counts tokens past a stop string, and takes them back once the front says so: a
    scrape in between must not see generation_tokens_total go down (Prometheus would read a reset)."""
    counts = {"num_generation_tokens": 10}
    engine = SimpleNamespace(metrics=lambda: dict(counts), num_step_errors=0, alive=True)
    metrics = ServerMetrics(engine)  # type: ignore[arg-type]

    def exported() -> float:
        return metric(metrics.render().decode(), "dspark:generation_tokens_total")

    assert exported() == 10
    counts["num_generation_tokens"] = 7  # 3 tokens past a stop string, taken back after that scrape
    assert exported() == 10
    counts["num_generation_tokens"] = 12  # new tokens make up for them
    assert exported() == 12
