"""`dspark bench throughput` on tiny random models: valid JSON, both arms measured, both computing the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dspark import LLM
from dspark.bench.prompts import BUILTIN_PROMPTS
from dspark.bench.throughput import build_hf_model, load_prompts, run_dspark, run_hf, tokenize
from dspark.cli import main
from dspark.errors import ConfigError
from helpers import FAMILIES

SMALL = ["--num-prompts", "4", "--output-len", "8", "--batch-size", "2", "--num-kv-blocks", "128"]


def test_builtin_prompts() -> None:
    assert len(BUILTIN_PROMPTS) >= 32
    assert len(set(BUILTIN_PROMPTS)) == len(BUILTIN_PROMPTS)
    assert all(isinstance(p, str) and p.strip() for p in BUILTIN_PROMPTS)
    assert load_prompts(None, 3) == BUILTIN_PROMPTS[:3]
    assert load_prompts(None, len(BUILTIN_PROMPTS) + 2)[-2:] == BUILTIN_PROMPTS[:2]  # the set repeats, in order


def test_dataset_path(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "a"}, {"turns": ["b", "later"]}, {"question": "c", "answer": "x"}, {}]
    path.write_text("\n".join(json.dumps(r) for r in lines[:3]) + "\n\n")
    assert load_prompts(str(path), 4) == ["a", "b", "c", "a"]

    path.write_text("\n".join(json.dumps(r) for r in lines))
    with pytest.raises(ConfigError, match=r"dataset_path.*p\.jsonl:4"):
        load_prompts(str(path), 1)
    with pytest.raises(ConfigError, match="dataset_path"):
        load_prompts(str(tmp_path / "missing.jsonl"), 1)


def test_bench_throughput_json(
    tiny_model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", str(tiny_model_dirs["llama"]), *SMALL, "--output-json", str(out)]
    assert main(argv) == 0
    summary = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out.read_text())
    assert len(summary) == 1 and summary[0].startswith("batch 2: dspark") and f"{result['ratio']:.2f}x" in summary[0]

    assert result["command"].startswith("dspark bench throughput --model")
    assert {"cpu_count", "torch_version", "device"} <= result["machine"].keys()
    assert result["config"]["total_input_tokens"] > 0 and result["config"]["chat"] is True
    for arm in ("dspark", "hf"):
        assert result[arm]["num_requests"] == 4
        assert result[arm]["output_tokens"] == 4 * 8
        assert result[arm]["elapsed_s"] > 0 and result[arm]["output_throughput"] > 0
    assert result["ratio"] == pytest.approx(result["dspark"]["output_throughput"] / result["hf"]["output_throughput"])
    assert result["greedy_agreement"]["identical_outputs"] == 4


def test_bench_throughput_batch_sizes_and_prefill(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """One decode row per batch size and one prefill row per prompt length, each against transformers."""
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", str(tiny_model_dirs["llama"]), *SMALL[:4], "--num-kv-blocks", "128"]
    argv += ["--batch-size", "1", "3", "--prefill-len", "16", "64", "--output-json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [row["batch_size"] for row in result["decode"]] == [1, 3]
    for row in result["decode"]:
        assert row["dspark"]["output_tokens"] == row["hf"]["output_tokens"] == 4 * 8
        assert row["greedy_agreement"]["identical_outputs"] == 4
    assert result["dspark"]["output_throughput"] == result["decode"][0]["dspark"]["output_throughput"]
    assert [row["prompt_len"] for row in result["prefill"]] == [16, 64]
    for row in result["prefill"]:
        assert row["dspark_ttft_s"] > 0 and row["hf_forward_s"] > 0
        assert row["ratio"] == pytest.approx(row["hf_forward_s"] / row["dspark_ttft_s"])  # one round: no median
    assert result["prefill_growth"] == pytest.approx(
        result["prefill"][1]["dspark_ttft_s"] / result["prefill"][0]["dspark_ttft_s"]
    )


def test_bench_throughput_without_hf(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", str(tiny_model_dirs["llama"]), *SMALL, "--no-hf", "--no-chat"]
    assert main([*argv, "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["hf"] is None and result["ratio"] is None and result["dspark"]["output_tokens"] == 32


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--num-prompts", "0"], "num_prompts"),
        (["--output-len", "0"], "output_len"),
        (["--batch-size", "0"], "batch_size"),
        (["--batch-size", "2", "-1"], "batch_size"),
        (["--prefill-len", "0"], "prefill_len"),
        (["--dataset-path", "/no/such.jsonl"], "dataset_path"),
        (["--output-json", "/no/such/dir/x.json"], "output_json"),
        (["--model", "/no/such/model"], "/no/such/model"),
    ],
)
def test_bench_bad_values(flags: list[str], field: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "throughput", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_arm_matches_dspark(tiny_model_dirs: dict[str, Path], family: str) -> None:
    """The transformers model built from dspark's weights decodes the same greedy tokens, batched and padded."""
    llm = LLM(model=str(tiny_model_dirs[family]), num_kv_blocks=128, max_num_seqs=3)
    prompt_ids = tokenize(llm, ["Hi", "Tell me about the sea, please", "2 + 2 ="], chat=False)
    ours = run_dspark(llm.engine, prompt_ids, output_len=6)
    hf_model = build_hf_model(llm.engine.model, torch.device("cpu"), torch.float32)
    theirs = run_hf(hf_model, prompt_ids, output_len=6, batch_size=3, pad_token_id=0)
    assert ours.outputs == theirs.outputs
    assert ours.output_tokens == theirs.output_tokens == 18


def test_output_must_fit_context(tiny_model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "throughput", "--model", str(tiny_model_dirs["llama"]), *SMALL, "--max-model-len", "64"]
    assert main([*argv, "--output-len", "60"]) == 2
    assert capsys.readouterr().err.startswith("error: output_len=60")
