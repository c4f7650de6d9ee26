"""`dspark serve` with async scheduling (on by default on CUDA; forced on here, on CPU): concurrent requests, whole and
streamed, greedy and seeded, ending by length or by a stop string, give what the synchronous server gives, while its
steps overlap; a client that hangs up mid-stream is aborted and its blocks come back, with a step launched for it in
flight."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from server_harness import MODEL_NAME, drained, live_server, make_engine, metric, scrape, wait_for
from test_metrics import LONG, _open_request

from dspark.engine.llm_engine import LLMEngine

PROMPTS = [f"one two three four five {i} one two three" for i in range(6)]


@pytest.fixture(scope="module")
def servers(tiny_llama: Path) -> Iterator[dict[bool, tuple[str, LLMEngine]]]:
    engines = {mode: make_engine(tiny_llama, async_scheduling=mode) for mode in (False, True)}
    with live_server(engines[False]) as sync_url, live_server(engines[True]) as async_url:
        yield {False: (sync_url, engines[False]), True: (async_url, engines[True])}


def _requests(url: str, stop: str | None = None) -> list[tuple[str, str | None]]:
    """Six concurrent requests, half streamed: each one's text and finish reason, in order (request 4 stops at
    `stop`)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

    def one(i: int) -> tuple[str, str | None]:
        kw: dict[str, Any] = {"max_tokens": 10 + 7 * i, "temperature": 0.0 if i % 3 else 1.0, "seed": 100 + i}
        kw["extra_body"] = {"ignore_eos": True}
        if i == 4 and stop:
            kw["stop"] = [stop]  # ends mid-run while the others go on
        if i % 2:
            text, reason = "", None
            for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPTS[i], stream=True, **kw):
                for c in chunk.choices:
                    text += c.text
                    reason = c.finish_reason or reason
            return text, reason
        c = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[i], **kw).choices[0]
        return c.text, c.finish_reason

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


def test_concurrent_requests_match_the_synchronous_server(servers: dict[bool, tuple[str, LLMEngine]]) -> None:
    full = _requests(servers[False][0])[4][0]
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # a piece of request 4's text: it stops halfway
    before = metric(scrape(servers[True][0]), "dspark:engine_pipelined_steps_total")
    got = _requests(servers[True][0], stop)
    assert got == _requests(servers[False][0], stop)
    assert any(reason == "stop" for _, reason in got) and any(reason == "length" for _, reason in got)
    after = scrape(servers[True][0])
    assert metric(after, "dspark:engine_pipelined_steps_total") > before  # the steps did overlap
    assert metric(scrape(servers[False][0]), "dspark:engine_pipelined_steps_total") == 0
    assert metric(after, "dspark:num_requests_running") == 0 and metric(after, "dspark:kv_cache_num_used_blocks") == 0


def test_a_client_that_hangs_up_mid_stream_is_aborted(servers: dict[bool, tuple[str, LLMEngine]]) -> None:
    url, engine = servers[True]
    before = scrape(url)
    sock = _open_request(url, {**LONG, "stream": True})
    received = b""
    while received.count(b"data: ") < 5:  # steps are overlapping by now
        received += sock.recv(4096)
    sock.close()

    wait_for(lambda: drained(url), what="running requests and used blocks to return to 0")
    after = scrape(url)
    aborted = 'finished_reason="abort"'
    success = "dspark:request_success_total"
    assert metric(after, success, aborted) - metric(before, success, aborted) == 1
    assert metric(after, "dspark:engine_pipelined_steps_total") > metric(before, "dspark:engine_pipelined_steps_total")
    # and the server goes on serving, with the synchronous server's output
    assert _requests(url) == _requests(servers[False][0])
    assert engine.kv.num_used_blocks == 0
