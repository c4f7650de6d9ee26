"""End to end: `dspark bench serve` and `dspark eval gsm8k` against a live dspark server on a tiny random model with
n-gram speculation (skipped while dspark.server is absent)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fake_openai_server import serve_app

from dspark.cli import main

PROMPTS = [f"count with me: {' '.join(str(i % 7) for i in range(start, start + 40))}" for start in range(4)]
PROBLEMS = [
    ("Tom has 3 apples and buys 4 more. How many apples?", "3 + 4 = <<3+4=7>>7\n#### 7"),
    ("A box holds 12 eggs. How many eggs in 5 boxes?", "12 * 5 = <<12*5=60>>60\n#### 60"),
    ("Sara had $1,000 and spent $250. How much is left?", "1000 - 250 = 750\n#### 750"),
    ("How many legs do 6 spiders have?", "6 * 8 = 48\n#### 48"),
]


@pytest.fixture(scope="module")
def live_url(tiny_model_dirs: dict[str, Path]) -> Any:
    app_module = pytest.importorskip("dspark.server.app", reason="dspark.server is not there yet")
    from dspark.config import EngineConfig
    from dspark.engine.llm_engine import LLMEngine

    spec = {"method": "ngram", "num_speculative_tokens": 3, "enable_adaptive_verification": False}
    config = EngineConfig(
        model=str(tiny_model_dirs["llama"]),
        dtype="float32",
        device="cpu",
        max_model_len=1024,
        num_kv_blocks=256,
        speculative_config=spec,
    )
    with serve_app(app_module.build_app(LLMEngine(config), ["tiny"])) as url:
        yield url


def test_bench_serve_against_dspark_serve(live_url: str, tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n")
    args = ["bench", "serve", "--base-url", live_url, "--dataset-name", "jsonl", "--dataset-path", str(data)]
    args += ["--num-prompts", "4", "--output-len", "24", "--ignore-eos", "--max-concurrency", "2", "--disable-tqdm"]
    assert main([*args, "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["model_id"], result["completed"], result["failed"]) == ("tiny", 4, 0)
    assert result["total_output_tokens"] == 4 * 24  # ignore_eos: every request writes max_tokens
    assert result["total_input_tokens"] > 4 * 40 and result["max_concurrent_requests"] <= 2
    assert 0 < result["mean_ttft_ms"] < result["mean_e2el_ms"]
    drafts = result["spec_decode_num_drafts"]  # the prompts repeat, so n-gram lookup finds drafts
    draft_tokens, accepted = result["spec_decode_draft_tokens"], result["spec_decode_accepted_tokens"]
    assert drafts > 0 and drafts <= draft_tokens <= 3 * drafts  # n-gram lookup may draft fewer than k
    assert result["spec_decode_acceptance_rate"] == pytest.approx(100 * accepted / draft_tokens)
    assert result["spec_decode_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert len(result["spec_decode_per_position_acceptance_rates"]) == 3


def test_eval_gsm8k_against_dspark_serve(live_url: str, tmp_path: Path) -> None:
    data = tmp_path / "test.jsonl"
    data.write_text("\n".join(json.dumps({"question": q, "answer": a}) for q, a in PROBLEMS) + "\n")
    out = tmp_path / "gsm8k.json"
    args = ["eval", "gsm8k", "--base-url", live_url, "--data-path", str(data), "--train-path", str(data)]
    args += ["--num-shots", "2", "--num-questions", "4", "--output-json", str(out), "--save-detailed"]
    assert main([*args, "--disable-tqdm"]) == 0
    result = json.loads(out.read_text())
    assert (result["num_questions"], result["failed"]) == (4, 0)  # a random model: the accuracy means nothing
    assert result["num_correct"] + result["invalid"] <= 4 and result["total_output_tokens"] > 0
    assert all(r["finish_reason"] in ("stop", "length") for r in result["questions"])
