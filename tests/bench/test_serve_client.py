"""`dspark bench serve` and its client against a fake OpenAI-compatible server with known delays and counters."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
from fake_openai_server import ACCEPTED_PER_POS, DRAFTS, MODEL, Behaviour, FakeServer, serve

from dspark.bench.client import BACKENDS, Endpoint, _sse_data, arrival_offsets, run_in_workers, server_root
from dspark.bench.serve import DETAILED_FIELDS, run_benchmark, summary_table
from dspark.bench.serve_data import WORDS, ServePrompt, sample_prompts
from dspark.bench.spec_metrics import parse_samples, spec_decode_counters, spec_decode_stats
from dspark.cli import main
from dspark.errors import ConfigError

VLLM_KEYS = (
    "date",
    "backend",
    "model_id",
    "num_prompts",
    "max_concurrency",
    "request_rate",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")),
)


@pytest.fixture(scope="module")
def fake() -> Any:
    with serve() as server:
        yield server


def bench(
    server: FakeServer, behaviour: Behaviour, num_prompts: int = 6, backend: str = "openai", **kwargs: Any
) -> dict[str, Any]:
    server.reset(behaviour)
    endpoint = Endpoint(server.url, backend, BACKENDS[backend], MODEL)
    prompts = sample_prompts("random", num_prompts, random_input_len=12, random_output_len=8, seed=0)
    return asyncio.run(run_benchmark(endpoint, prompts, progress=False, **kwargs))


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_latencies_follow_the_injected_delays(fake: FakeServer, backend: str) -> None:
    result = bench(fake, Behaviour(ttft_s=0.15, itl_s=0.03, num_chunks=8), backend=backend)
    assert all(k in result for k in VLLM_KEYS)
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["total_output_tokens"] == 6 * 8  # from the usage chunk
    assert result["total_input_tokens"] == 6 * 12  # the server's count: 12 words each
    # The chat stream's role chunk comes at once; TTFT waits for the first text. No fixed upper bound (a loaded CI
    # machine adds hundreds of ms to the first connection): the e2el check below puts 7 gaps after it.
    assert result["mean_ttft_ms"] >= 140
    assert 25 <= result["median_itl_ms"] < 100
    assert 25 <= result["mean_tpot_ms"] < 100
    e2el = result["mean_e2el_ms"]
    assert result["mean_ttft_ms"] + 7 * 25 <= e2el < result["mean_ttft_ms"] + 7 * 100
    assert result["p99_ttft_ms"] >= result["median_ttft_ms"] and result["std_itl_ms"] >= 0
    assert result["request_throughput"] == pytest.approx(6 / result["duration"])
    assert result["total_token_throughput"] == pytest.approx((6 * 12 + 6 * 8) / result["duration"])
    assert len(result["itls"]) == 6 and all(len(itl) == 7 for itl in result["itls"])
    body = fake.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 8 and body["temperature"] == 0.0 and "ignore_eos" not in body
    assert ("messages" in body) == (backend == "openai-chat")


def test_itl_is_per_chunk_and_tpot_per_token(fake: FakeServer) -> None:
    """Speculation sends several tokens per chunk: ITL stays the chunk gap, TPOT divides by tokens."""
    result = bench(fake, Behaviour(ttft_s=0.05, itl_s=0.04, num_chunks=6, tokens_per_chunk=3), num_prompts=3)
    assert result["total_output_tokens"] == 3 * 18
    assert 35 <= result["median_itl_ms"] < 120
    # (E2E - TTFT) = 5 gaps of ~40 ms over 17 tokens
    assert result["mean_tpot_ms"] == pytest.approx(result["mean_itl_ms"] * 5 / 17, rel=0.25)


def test_failed_requests_are_counted_not_fatal(fake: FakeServer) -> None:
    result = bench(fake, Behaviour(num_chunks=4, fail_every=3, cut_every=4), num_prompts=12)
    # requests 3, 6, 9, 12 get HTTP 500; 4 and 8 are cut mid-stream
    assert (result["completed"], result["failed"]) == (6, 6)
    assert result["total_output_tokens"] == 6 * 4
    errors = [e for e in result["errors"] if e]
    assert sum(e.startswith("HTTP 500") for e in errors) == 4
    assert sum("before [DONE]" in e for e in errors) == 2
    assert "first error: HTTP 500" in summary_table(result)


def test_unreachable_server_fails_every_request() -> None:
    endpoint = Endpoint("http://127.0.0.1:9", "openai", "/v1/completions", MODEL)  # discard port: nothing listens
    prompts = sample_prompts("random", 3, random_input_len=4, random_output_len=4)
    result = asyncio.run(run_benchmark(endpoint, prompts, progress=False))
    assert (result["completed"], result["failed"]) == (0, 3)
    assert result["mean_ttft_ms"] == 0.0 and "spec_decode_num_drafts" not in result


def test_spec_decode_fields_from_the_metrics_delta(fake: FakeServer) -> None:
    """Only the timed requests count: the two warm-up requests' drafts happen before the first scrape."""
    result = bench(fake, Behaviour(num_chunks=3, fail_every=5), num_prompts=10, num_warmups=2)
    assert len(fake.bodies) == 12 and (result["completed"], result["failed"]) == (8, 2)  # requests 5 and 10 fail
    assert result["spec_decode_num_drafts"] == DRAFTS * 8
    assert result["spec_decode_draft_tokens"] == 6 * 8
    assert result["spec_decode_accepted_tokens"] == 3 * 8
    assert result["spec_decode_acceptance_rate"] == pytest.approx(50.0)
    assert result["spec_decode_acceptance_length"] == pytest.approx(2.5)
    expected = [a / DRAFTS for a in ACCEPTED_PER_POS]
    assert result["spec_decode_per_position_acceptance_rates"] == pytest.approx(expected)
    assert "Speculative Decoding" in summary_table(result)


def test_no_spec_fields_without_speculation(fake: FakeServer) -> None:
    result = bench(fake, Behaviour(num_chunks=2, spec=False), num_prompts=2)
    assert not any(k.startswith("spec_decode") for k in result)
    assert "Speculative Decoding" not in summary_table(result)


def test_max_concurrency_is_respected(fake: FakeServer) -> None:
    result = bench(fake, Behaviour(ttft_s=0.05, itl_s=0.01, num_chunks=4), num_prompts=10, max_concurrency=3)
    assert result["completed"] == 10
    assert fake.peak_in_flight == 3 and result["max_concurrent_requests"] == 3


def test_client_workers_share_the_load_and_keep_the_input_order(fake: FakeServer) -> None:
    fake.reset(Behaviour(ttft_s=0.05, itl_s=0.01, answer=lambda body: (f" echo {body['prompt']}", "stop")))
    endpoint = Endpoint(fake.url, "openai", BACKENDS["openai"], MODEL)
    prompts = [ServePrompt(f"prompt {i}", None, 4) for i in range(11)]
    result = asyncio.run(run_benchmark(endpoint, prompts, progress=False, max_concurrency=5, num_workers=3))
    assert (result["completed"], result["failed"], result["num_client_workers"]) == (11, 0, 3)
    assert [t.strip() for t in result["generated_texts"]] == [f"echo prompt {i}" for i in range(11)]
    assert len(fake.bodies) == 11 and 3 <= fake.peak_in_flight <= 5  # the shares (2, 2, 1) add up to 5
    assert result["max_concurrent_requests"] <= 5
    # every request waited >= 50 ms for its first chunk, so the run took at least the 3 waves of the busiest worker
    assert result["duration"] >= 3 * 0.05 and result["mean_ttft_ms"] >= 50
    with pytest.raises(ConfigError, match="num_workers"):
        run_in_workers(endpoint, [], 0)


def test_request_rate_paces_arrivals(fake: FakeServer) -> None:
    rate, n = 10.0, 10
    result = bench(fake, Behaviour(num_chunks=1), num_prompts=n, request_rate=rate, seed=3)
    expected = arrival_offsets(n, rate, seed=3)
    seen = [t - fake.arrivals[0] for t in fake.arrivals]
    assert seen == pytest.approx(expected, abs=0.05)
    assert result["duration"] >= expected[-1] and result["request_rate"] == rate


def test_arrival_offsets() -> None:
    assert arrival_offsets(4, math.inf, 0) == [0.0] * 4
    offsets = arrival_offsets(2000, 50.0, seed=1)
    assert offsets == arrival_offsets(2000, 50.0, seed=1) and offsets != arrival_offsets(2000, 50.0, seed=2)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50.0, rel=0.1)  # exponential gaps of mean 1 / rate


def test_metrics_text_parsing() -> None:
    text = (
        "# HELP vllm:spec_decode_num_drafts Drafts.\n# TYPE vllm:spec_decode_num_drafts counter\n"
        'vllm:spec_decode_num_drafts_total{engine="0"} 10.0\nvllm:spec_decode_num_drafts_total{engine="1"} 6\n'
        'vllm:spec_decode_num_drafts_created{engine="0"} 1.7e+09\n'
        "vllm:spec_decode_num_draft_tokens_total 48\nvllm:spec_decode_num_accepted_tokens_total 20\n"
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1",engine="0"} 5\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0",engine="0"} 15\n'
        "garbage line\n"
    )
    assert parse_samples('a_b{x="1",y="q\\"z"} 2.5 1700000000')[0] == ("a_b", {"x": "1", "y": 'q\\"z'}, 2.5)
    after = spec_decode_counters(text)
    assert after is not None and after.num_drafts == 16 and after.accepted_per_pos == {0: 15.0, 1: 5.0}
    before = spec_decode_counters("dspark:spec_decode_num_drafts_total 0\n")
    stats = spec_decode_stats(before, after)
    assert stats["spec_decode_acceptance_length"] == pytest.approx(1 + 20 / 16)
    assert stats["spec_decode_acceptance_rate"] == pytest.approx(100 * 20 / 48)
    assert stats["spec_decode_per_position_acceptance_rates"] == pytest.approx([15 / 16, 5 / 16])
    assert spec_decode_counters("dspark:num_requests_running 0\n") is None
    assert spec_decode_stats(after, after) == {}  # nothing drafted during the run


def test_prompt_sets(tmp_path: Path) -> None:
    words = sample_prompts("random", 3, random_input_len=20, random_output_len=5, seed=7)
    assert words == sample_prompts("random", 3, random_input_len=20, random_output_len=5, seed=7)
    assert all(len(p.text.split()) == 20 and set(p.text.split()) <= set(WORDS) for p in words)
    assert {p.output_len for p in words} == {5}
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ({"prompt": "a"}, {"turns": ["b", "x"]}, {"question": "c"})))
    in_order = sample_prompts("jsonl", 5, dataset_path=str(data), output_len=9, shuffle=False)
    assert [p.text for p in in_order] == ["a", "b", "c", "a", "b"] and in_order[0].output_len == 9
    shuffled = sample_prompts("gsm8k", 3, dataset_path=str(data), seed=1)
    assert sorted(p.text for p in shuffled) == ["a", "b", "c"]
    with pytest.raises(ConfigError, match="dataset_path"):
        sample_prompts("mt-bench", 3)
    with pytest.raises(ConfigError, match="random_input_len"):
        sample_prompts("random", 3, random_input_len=0)


def test_random_prompts_from_a_tokenizer(tokenizer_dir: Path) -> None:
    from dspark.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    prompts = sample_prompts("random", 4, tokenizer=tokenizer, random_input_len=64, random_output_len=8, seed=0)
    special = set(tokenizer.all_special_tokens)
    for p in prompts:
        assert p.prompt_len is not None and 48 <= p.prompt_len <= 80  # decode + encode moves the count a little
        assert not any(s in p.text for s in special)
    assert len({p.text for p in prompts}) == 4


def test_server_root() -> None:
    assert server_root(None, "localhost", 8001) == "http://localhost:8001"
    assert server_root("http://h:8000/v1/", "x", 1) == "http://h:8000"
    with pytest.raises(ConfigError, match="base_url"):
        server_root("h:8000", "x", 1)


def test_cli_writes_the_result_json(fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake.reset(Behaviour(ttft_s=0.01, num_chunks=4))
    common = ["bench", "serve", "--base-url", fake.url, "--num-prompts", "5", "--random-input-len", "10"]
    common += ["--random-output-len", "4", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path)]
    assert main([*common, "--result-filename", "detailed.json", "--save-detailed", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Successful requests:" in out
    result = json.loads((tmp_path / "detailed.json").read_text())
    assert all(k in result for k in (*VLLM_KEYS, *DETAILED_FIELDS))
    assert result["model_id"] == MODEL and result["request_rate"] == "inf" and result["completed"] == 5
    assert result["input_lens"] == [10] * 5 and result["output_lens"] == [4] * 5
    assert fake.bodies[0]["ignore_eos"] is True and fake.bodies[0]["model"] == MODEL
    assert main([*common, "--max-concurrency", "2"]) == 0
    (plain,) = [p for p in tmp_path.iterdir() if p.name != "detailed.json"]
    assert plain.name.startswith("openai-infqps-concurrency2-fake-model-")
    assert not any(k in json.loads(plain.read_text()) for k in DETAILED_FIELDS)


def test_api_key_goes_everywhere(fake: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.reset(Behaviour(num_chunks=1))
    args = ["bench", "serve", "--base-url", fake.url, "--num-prompts", "1", "--random-input-len", "2", "--disable-tqdm"]
    assert main([*args, "--api-key", "k1"]) == 0
    paths = ("/v1/models", "/v1/completions", "/metrics")
    assert fake.auth == {(p, "Bearer k1") for p in paths}
    fake.reset(Behaviour(num_chunks=1))
    monkeypatch.setenv("OPENAI_API_KEY", "k2")
    assert main(args) == 0
    assert fake.auth == {(p, "Bearer k2") for p in paths}


def test_sse_parsing_across_fragments() -> None:
    """Events split anywhere by the network, CRLF line ends, a multi-byte character cut in two."""

    class Content:
        async def iter_any(self) -> Any:
            stream = 'data: {"a": "é"}\r\n\r\n: keep-alive\n\ndata: [DONE]'.encode()
            for cut in (3, 11, 20, 30):
                yield stream[:cut]
                stream = stream[cut:]
            yield stream

    class Response:
        content = Content()

    async def collect() -> list[str]:
        return [data async for data, _ in _sse_data(Response())]  # type: ignore[arg-type]

    assert asyncio.run(collect()) == ['{"a": "é"}', "[DONE]"]


def test_cli_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--max-concurrency", "0"]) == 2
    assert "max_concurrency=0 is invalid" in capsys.readouterr().err
    assert main(["bench", "serve", "--request-rate", "-1"]) == 2
    assert "request_rate=-1.0 is invalid" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err
    down = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "2"]
    assert main([*down, "--random-input-len", "4", "--disable-tqdm"]) == 1  # ran, but measured nothing
    captured = capsys.readouterr()
    assert "Failed requests:                         2" in captured.out and "every request failed" in captured.err
