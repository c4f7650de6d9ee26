"""Live servers for the server tests: uvicorn in a background thread on a free loopback port, over a tiny model;
and reading their /metrics."""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dspark.config import EngineConfig
from dspark.engine.llm_engine import LLMEngine
from dspark.speculative.cost_model import CostModel

# Verifying costs a twentieth of a step per token: adaptive verification verifies most drafts but not always all,
# and the tests need no start-up profiling.
COST = CostModel.from_points({1: 4.0, 16: 7.0, 64: 16.0}, {1: 0.5, 64: 0.5})
MODEL_NAME = "tiny"


def make_engine(model: Path, spec: dict[str, Any] | None = None, **kw: Any) -> LLMEngine:
    kw = {"dtype": "float32", "device": "cpu", "max_model_len": 1024, "num_kv_blocks": 256, **kw}
    return LLMEngine(EngineConfig(model=str(model), speculative_config=spec, **kw), COST if spec else None)


@contextmanager
def live_server(engine: LLMEngine, **app_kwargs: Any) -> Iterator[str]:
    """The app over `engine` served on 127.0.0.1:<free port>; yields the base URL (without /v1)."""
    import uvicorn

    from dspark.server.app import build_app

    app = build_app(engine, [MODEL_NAME, "other-name"], **app_kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def scrape(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample of Prometheus text (0 when absent), e.g. metric(t, "dspark:request_success_total",
    'finished_reason="stop"')."""
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def drained(url: str) -> bool:
    """No request running and no KV block in use, by the server's /metrics."""
    now = scrape(url)
    return metric(now, "dspark:num_requests_running") == 0 and metric(now, "dspark:kv_cache_num_used_blocks") == 0


def wait_for(predicate: Any, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
