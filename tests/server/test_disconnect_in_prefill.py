"""A request (streamed or not) whose client hangs up while its long prompt is still being prefilled (in chunks of
max_num_batched_tokens) is aborted within a step or two, with the engine in the server's process and in its own: its
KV blocks return to the pool and it leaves the scheduler long before its prefill would have ended, it never produces a
token, and nothing is left behind.

Each step is slowed to STEP_S, so that the prefill (PROMPT_LEN / CHUNK steps) lasts seconds whatever the machine."""

from __future__ import annotations

import functools
import json
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch
from server_harness import MODEL_NAME, drained, live_server, make_engine, metric, scrape, wait_for

from dspark.config import EngineConfig
from dspark.engine.core import EngineCore
from dspark.engine.core_proc import run_core
from dspark.engine.messages import EngineCoreOutput
from dspark.server.process_engine import ProcessEngine
from helpers import make_hf_model

STEP_S = 0.1
PROMPT_LEN = 6000
CHUNK = 64  # ~94 prefill steps: ~9 s
ENGINE: dict[str, Any] = {"max_model_len": 8192, "max_num_batched_tokens": CHUNK, "num_kv_blocks": 600}


class _SlowCore(EngineCore):
    def step(self) -> list[EngineCoreOutput]:
        time.sleep(STEP_S)
        return super().step()


def _slow_core(config: EngineConfig) -> EngineCore:
    return _SlowCore(config)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("tiny-long-context")
    make_hf_model("llama", max_position_embeddings=8192).save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request: pytest.FixtureRequest, long_model: Path) -> Iterator[str]:
    if request.param == "thread":
        engine: Any = make_engine(long_model, **ENGINE)
        step = engine.step

        def slow_step() -> Any:
            time.sleep(STEP_S)
            return step()

        engine.step = slow_step
    else:
        config = EngineConfig(model=str(long_model), dtype="float32", device="cpu", **ENGINE)
        engine = ProcessEngine(config, core_target=functools.partial(run_core, make_core=_slow_core))
    with live_server(engine) as url:
        wait_for(lambda: metric(scrape(url), "dspark:engine_alive") == 1, 120, "the engine to be ready")
        yield url


def _request(url: str, prompt: list[int], stream: bool) -> socket.socket:
    """A completion on a raw socket; streamed: once the response has begun (its head received)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "stream": stream}
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
    sock.sendall(head.encode() + b"\r\n\r\n" + data)
    received = b""
    while stream and b"\r\n\r\n" not in received:
        received += sock.recv(4096)
    assert not stream or received.startswith(b"HTTP/1.1 200"), received
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_during_the_prefill_frees_its_blocks(server: str, stream: bool) -> None:
    url = server
    prompt = torch.randint(3, 49152, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()
    before = scrape(url)
    sock = _request(url, prompt, stream)
    wait_for(lambda: metric(scrape(url), "dspark:kv_cache_num_used_blocks") >= 8, what="the prefill to be under way")
    at_close = scrape(url)
    sock.close()
    closed = time.monotonic()
    wait_for(lambda: drained(url), timeout=10, what="the blocks to come back")
    waited = time.monotonic() - closed
    after = scrape(url)

    def delta(name: str, since: str = before, labels: str = "") -> float:
        return metric(after, name, labels) - metric(since, name, labels)

    num_chunks = PROMPT_LEN // CHUNK
    steps_after_close = delta("dspark:engine_steps_total", at_close)
    print(f"steps: {delta('dspark:engine_steps_total')} in all, {steps_after_close} after the hang-up ({waited:.2f} s)")
    assert metric(at_close, "dspark:kv_cache_num_used_blocks") < PROMPT_LEN // 16, "the prefill had already ended"
    assert delta("dspark:generation_tokens_total") == 0, "the prompt was prefilled to its end"
    assert delta("dspark:engine_steps_total") < num_chunks // 3
    assert steps_after_close <= 3, "the abort took more than a step or two to reach the scheduler"
    assert delta("dspark:request_success_total", labels='finished_reason="abort"') == 1
    assert delta("dspark:num_requests_aborted_total") == 1
    assert metric(after, "dspark:num_requests_waiting") == 0 and metric(after, "dspark:kv_cache_usage_perc") == 0
