"""Load: `dspark bench load`'s logic against live CPU servers on a tiny random llama with n-gram speculation and
adaptive verification on.

- Hundreds of streaming requests, 64 at once, a fifth hanging up mid-stream, over three rounds: every completed output
  equals the prompt's output alone, none fails, the server ends each round with no request running or waiting and no
  KV block in use, its memory does not grow from round to round, and it still answers as before afterwards.
- A KV cache too small for the load, so requests are preempted and recomputed while drafting: every streamed output
  still equals its reference, each stream lists exactly the tokens usage counts (none duplicated or lost between
  chunks), and the whole (non-streamed) response of each prompt has the same text and token count.
- The checks themselves catch a changed output, a miscounted stream and memory growth.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fake_openai_server import serve_app

from dspark.bench.client import Endpoint, RequestResult
from dspark.bench.load import PROMPTS, LoadSettings, Outcome, check_outcome, problems, run_load
from dspark.config import EngineConfig
from dspark.engine.llm_engine import LLMEngine
from dspark.server.app import build_app
from dspark.speculative.cost_model import CostModel

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "enable_adaptive_verification": True}
# Verifying costs a twentieth of a step per token, so adaptive verification verifies most drafts but not always all;
# a given cost model also spares the start-up profiling.
COST = CostModel.from_points({1: 4.0, 16: 7.0, 64: 16.0}, {1: 0.5, 64: 0.5})
MAX_TOKENS = 16
MODEL_NAME = "tiny"


@contextmanager
def _server(model: Path, num_kv_blocks: int) -> Iterator[str]:
    config = EngineConfig(
        model=str(model),
        dtype="float32",
        device="cpu",
        max_model_len=128,  # the tiny cache must still hold one request of the longest length
        num_kv_blocks=num_kv_blocks,
        speculative_config=SPEC,
    )
    with serve_app(build_app(LLMEngine(config, COST), [MODEL_NAME])) as url:
        yield url


def _load(url: str, settings: LoadSettings) -> dict[str, Any]:
    endpoint = Endpoint(url, "openai", "/v1/completions", MODEL_NAME)
    return asyncio.run(run_load(endpoint, settings, progress=False))


def test_rounds_of_load_with_disconnects_lose_nothing(tiny_model_dirs: dict[str, Path]) -> None:
    # The server runs in this process, so its RSS is this process's (the client's few MiB included).
    settings = LoadSettings(
        concurrency=64, duration=4.0, rounds=3, disconnect_fraction=0.2, max_tokens=MAX_TOKENS, server_pid=os.getpid()
    )
    with _server(tiny_model_dirs["llama"], num_kv_blocks=512) as url:
        result = _load(url, settings)
    assert result["ok"], result["problems"]
    assert result["requests"] >= 200 and result["failed"] == 0 and result["mismatched"] == 0
    assert result["completed"] >= 0.6 * result["requests"]
    assert result["disconnected"] >= 0.1 * result["requests"]
    assert 0 < result["server_aborts"] <= result["disconnected"]  # a hang-up after the last token aborts nothing
    assert result["requests_held"] >= 32, "the load was meant to keep ~64 requests in the server at once"
    assert result["spec_decode_num_drafts"] > 0, "speculation was meant to be on"
    assert all(result["references_unchanged_after"])
    for r in result["rounds"]:
        assert r["after"]["running"] == r["after"]["waiting"] == r["after"]["kv_cache_usage_perc"] == 0
        assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
        assert r["rss_before_mib"] > 0 and r["rss_after_mib"] > 0
    assert result["rounds"][-1]["rss_after_mib"] - result["rounds"][0]["rss_after_mib"] <= settings.rss_tolerance_mb


def test_preemption_under_kv_pressure_keeps_streams_exact(tiny_model_dirs: dict[str, Path]) -> None:
    # 12 blocks of 16 slots: ~6 requests fit where 32 are sent at once, so most are preempted and recomputed.
    settings = LoadSettings(
        concurrency=32, duration=3.0, rounds=1, disconnect_fraction=0.2, max_tokens=MAX_TOKENS, logprobs=True
    )
    with _server(tiny_model_dirs["llama"], num_kv_blocks=12) as url:
        result = _load(url, settings)
        wholes = [_whole(url, prompt) for prompt in PROMPTS]
    assert result["ok"], result["problems"]
    assert result["preemptions"] > 0, "the cache was meant to force preemption"
    assert result["completed"] > 0 and result["failed"] == result["mismatched"] == 0
    assert all(ref["output_tokens"] > 0 for ref in result["references"])
    for ref, whole in zip(result["references"], wholes, strict=True):
        assert whole["choices"][0]["text"] == ref["text"]
        assert whole["usage"]["completion_tokens"] == ref["output_tokens"]
    r = result["rounds"][0]
    assert r["after"]["running"] == r["after"]["waiting"] == r["after"]["kv_cache_usage_perc"] == 0


def _whole(url: str, prompt: str) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.mark.parametrize(
    ("got", "why"),
    [
        (RequestResult(success=True, text="a b d", output_tokens=3, num_logprob_tokens=3), "text differs"),
        (RequestResult(success=True, text="a b c", output_tokens=4, num_logprob_tokens=4), "usage says 4"),
        (RequestResult(success=True, text="a b c", output_tokens=3, num_logprob_tokens=4), "the stream listed 4"),
    ],
)
def test_the_check_catches_a_changed_output(got: RequestResult, why: str) -> None:
    ref = RequestResult(success=True, text="a b c", output_tokens=3, num_logprob_tokens=3)
    assert check_outcome(Outcome(0, None, ref), ref, logprobs=True) is None
    found = check_outcome(Outcome(0, None, got), ref, logprobs=True)
    assert found is not None and found.startswith(why)


def test_memory_growth_across_rounds_is_a_problem() -> None:
    settings = LoadSettings(rss_tolerance_mb=10.0)
    rounds = [{"round": k, "after": {"idle": 1.0}, "rss_after_mib": mib} for k, mib in enumerate((500.0, 530.0))]
    result = {"mismatched": 0, "failed": 0, "references_unchanged_after": [True], "rounds": rounds}
    assert any("RSS grew 30 MiB" in p for p in problems(result, settings))
    rounds[1]["rss_after_mib"] = 505.0
    assert problems(result, settings) == []
