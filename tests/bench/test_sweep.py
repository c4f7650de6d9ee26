"""`dspark bench sweep` on a tiny random llama: one row per arm, concurrency and temperature with every key, greedy
outputs that no arm changes, the three output files, and bad arguments named before any model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.bench.prompts import BUILTIN_PROMPTS
from dspark.bench.sweep import (
    ADAPTIVE_K,
    Sweep,
    num_prompts_for,
    parse_arm,
    run_sweep,
    sweep_prompts,
    write_outputs,
)
from dspark.cli import main
from dspark.config import EngineConfig, SpeculativeConfig
from dspark.errors import ConfigError

ARMS = ["no-spec", "fixed-1", "adaptive"]
CONCURRENCIES = [1, 4]
TEMPERATURES = [0.0, 1.0]
NUM_PROMPTS, OUTPUT_LEN = 8, 8
ROW_KEYS = {
    "arm",
    "concurrency",
    "temperature",
    "output_throughput",
    "rounds_output_throughput",
    "acceptance_length",
    "mean_verify_len",
    "duration",
    "completed",
    "max_in_flight",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "total_token_throughput",
    *(f"{stat}_{name}_ms" for stat in ("mean", "median", "p99") for name in ("ttft", "tpot", "e2el")),
    "num_preemptions",
    "spec_decode_acceptance_length",
    "spec_decode_num_drafts",
    "spec_decode_draft_tokens",
    "spec_decode_accepted_tokens",
    "verify_budget_mean",
    "num_steps_without_drafting",
    "identical_to_no_spec",
}


@pytest.fixture(scope="module")
def sweep(tiny_model_dirs: dict[str, Path]) -> Sweep:
    config = EngineConfig(model=str(tiny_model_dirs["llama"]), num_kv_blocks=128)
    return run_sweep(
        config,
        arms=ARMS,
        concurrencies=CONCURRENCIES,
        temperatures=TEMPERATURES,
        output_len=OUTPUT_LEN,
        num_prompts=NUM_PROMPTS,
        command="test",
    )


def test_rows(sweep: Sweep) -> None:
    rows = sweep.result["rows"]
    assert [(r["temperature"], r["concurrency"], r["arm"]) for r in rows] == [
        (t, c, a) for t in TEMPERATURES for c in CONCURRENCIES for a in ARMS
    ]
    for row in rows:
        assert row.keys() == ROW_KEYS
        assert row["completed"] == NUM_PROMPTS
        assert row["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos: every request runs to the end
        assert row["max_in_flight"] == row["concurrency"]  # the limit holds and is reached
        assert row["output_throughput"] > 0 and row["rounds_output_throughput"] == [row["output_throughput"]]
        assert row["output_throughput"] == pytest.approx(row["total_output_tokens"] / row["duration"])
        assert 0 < row["mean_ttft_ms"] <= row["p99_ttft_ms"] and row["mean_tpot_ms"] > 0
        if row["arm"] == "no-spec":
            assert row["acceptance_length"] is None and row["mean_verify_len"] is None
            assert row["spec_decode_num_drafts"] is None
            continue
        k = 1 if row["arm"] == "fixed-1" else ADAPTIVE_K
        assert (
            row["spec_decode_accepted_tokens"] <= row["spec_decode_draft_tokens"] <= k * row["spec_decode_num_drafts"]
        )
        assert row["acceptance_length"] == row["spec_decode_acceptance_length"]
        steps = row["total_output_tokens"] - row["spec_decode_accepted_tokens"]
        assert row["mean_verify_len"] == pytest.approx(row["spec_decode_draft_tokens"] / steps)
        # Greedy, the random model repeats itself and n-grams match; sampled, they do not. Adaptive verification may
        # rightly verify none (it follows measured step times, which on a busy CI machine are noise at this size).
        if row["temperature"] == 0 and row["arm"] != "adaptive":
            assert row["spec_decode_num_drafts"] > 0 and row["acceptance_length"] >= 1
        if row["arm"] == "adaptive":
            assert row["num_steps_without_drafting"] >= 0
            assert row["verify_budget_mean"] is not None or row["spec_decode_num_drafts"] == 0
        else:
            assert row["verify_budget_mean"] is None and row["num_steps_without_drafting"] is None


def test_greedy_outputs_match_no_spec(sweep: Sweep) -> None:
    for c in CONCURRENCIES:
        base = sweep.token_ids["no-spec", c, 0.0]
        assert len(base) == NUM_PROMPTS and all(len(t) == OUTPUT_LEN for t in base)
        for arm in ARMS:
            assert sweep.token_ids[arm, c, 0.0] == base
    for row in sweep.result["rows"]:
        assert row["identical_to_no_spec"] == (f"{NUM_PROMPTS}/{NUM_PROMPTS}" if row["temperature"] == 0 else None)


def test_writes_json_plot_and_markdown(sweep: Sweep, tmp_path: Path) -> None:
    paths = tmp_path / "s.json", tmp_path / "s.png", tmp_path / "s.md"
    write_outputs(sweep.result, *paths)
    result = json.loads(paths[0].read_text())
    assert {"command", "config", "device", "dtype", "machine", "rows"} <= result.keys()
    assert list(result["config"]["arms"]) == ARMS and result["config"]["arms"]["no-spec"] is None
    assert result["config"]["arms"]["adaptive"]["num_speculative_tokens"] == ADAPTIVE_K
    assert result["config"]["engine"]["max_num_seqs"] == max(CONCURRENCIES)
    assert "token_ids" not in paths[0].read_text()
    assert paths[1].read_bytes().startswith(b"\x89PNG")
    table = paths[2].read_text().splitlines()
    assert "adaptive / max(no-spec, best fixed)" in table[0]
    assert len([line for line in table if line.startswith("| ")]) == 1 + len(TEMPERATURES) * len(CONCURRENCIES)
    assert table[-1].startswith("adaptive / max(no-spec, best fixed): median")


def test_cli(tiny_model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "sweep", "--model", str(tiny_model_dirs["llama"]), "--num-kv-blocks", "128", "--arm", "no-spec"]
    argv += ["--concurrency", "2", "--temperature", "0", "--num-prompts", "3", "--output-len", "4"]
    assert main([*argv, "--output-json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("| T | C | no-spec tok/s |") and out[-1].startswith("fastest arm: no-spec in 1/1 rows")
    row = json.loads((tmp_path / "s.json").read_text())["rows"][0]
    assert row["total_output_tokens"] == 12 and row["max_in_flight"] == 2


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--arm", "fixed-x"], "arm"),
        (["--arm", "fixed-0"], "arm"),
        (["--concurrency", "4", "0"], "concurrency"),
        (["--dataset-path", "/no/such.jsonl"], "dataset_path"),
        (["--num-prompts", "0"], "num_prompts"),
        (["--temperature", "-1"], "temperature"),
        (["--hf"], "hf"),
        (["--output-plot", "/no/such/dir/x.png"], "output_plot"),
    ],
)
def test_bad_arguments(flags: list[str], field: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sweep", "--model", "/no/such/model", *flags]) == 2  # named before any model is loaded
    assert capsys.readouterr().err.startswith(f"error: {field}=")


def test_prompt_order(tmp_path: Path) -> None:
    builtin = sweep_prompts([])
    assert sorted(builtin) == sorted(BUILTIN_PROMPTS) and builtin == sweep_prompts([])  # a fixed order
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps({"prompt": p}) for p in ("a1", "a2", "a3")))
    b.write_text(json.dumps({"turns": ["b1", "later"]}))
    assert sweep_prompts([str(a), str(b)]) == ["a1", "b1", "a2", "a3"]
    assert [num_prompts_for(c, None) for c in (1, 8, 64)] == [16, 16, 128]
    assert num_prompts_for(64, 10) == 10


def test_arm_configs() -> None:
    base = EngineConfig(model="m")
    assert parse_arm("no-spec").config(base, SpeculativeConfig("ngram")).spec is None
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, enable_adaptive_verification=True)
    fixed = parse_arm("fixed-3").config(base, spec).spec
    assert fixed is not None and (fixed.num_speculative_tokens, fixed.enable_adaptive_verification) == (3, False)
    adaptive = parse_arm("adaptive").config(base, spec).spec
    assert adaptive is not None and (adaptive.num_speculative_tokens, adaptive.enable_adaptive_verification) == (
        4,
        True,
    )
    default = parse_arm("adaptive").config(base, SpeculativeConfig("ngram")).spec
    assert default is not None and default.num_speculative_tokens == ADAPTIVE_K
    with pytest.raises(ConfigError, match="arm"):
        parse_arm("fixed-33")
