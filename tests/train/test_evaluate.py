"""`dspark eval-drafter` and `dspark calibrate-drafter`: the metrics' maths on hand-computed and synthetic cases, then
both commands end to end on a tiny random target with a random drafter (CPU, fp32)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from dspark.cli import main
from dspark.models.loader import load_config
from dspark.speculative.drafters.dspark.checkpoint import random_drafter, save_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig
from dspark.speculative.trace import load_trace
from dspark.train.calibrate import fit_sts, logits_from_confidences, survival_outcomes
from dspark.train.evaluate import acceptance, auroc, calibration, evaluate_drafter, markdown_table
from dspark.utils.jsonl import read_jsonl_prompts

K = 4
PROMPTS = ["What is 2 + 2?", "Write a haiku about tea.", "Name three rivers.", "Count to five."]
ENGINE = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 128}
CLI_ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "128"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs: dict[str, Path]) -> str:
    return str(tiny_model_dirs["llama"])


@pytest.fixture
def drafter(tmp_path: Path, tiny: str) -> Path:
    """Saved per test: calibrate-drafter rewrites its config."""
    cfg = DSparkConfig.for_target(load_config(Path(tiny)), block_size=K, num_taps=1, markov_rank=4)
    return save_drafter(random_drafter(cfg), tmp_path / "drafter")


def _jsonl(path: Path, prompts: list[str]) -> Path:
    text = "".join(json.dumps({"turns": [p, "a second turn, unused"]}) + "\n" for p in prompts)
    path.write_bytes(gzip.compress(text.encode()) if path.suffix == ".gz" else text.encode())
    return path


# ---- maths --------------------------------------------------------------------------------------------------------


def test_auroc_by_hand_with_ties() -> None:
    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    # Positives {0.5, 0.9} against negatives {0.5, 0.2}: pairs 0.5-0.5 (a tie, 1/2), 0.5-0.2, 0.9-0.5, 0.9-0.2.
    assert auroc(torch.tensor([0.5, 0.5, 0.2, 0.9]), torch.tensor([1, 0, 0, 1])) == 3.5 / 4
    assert auroc(torch.full((6,), 0.3), torch.tensor([1, 0, 1, 0, 0, 1])) == 0.5  # all tied: chance
    assert auroc(torch.tensor([0.2, 0.7]), torch.tensor([1, 1])) is None  # no negative


def test_acceptance_per_position() -> None:
    blocks = (torch.zeros(4, 3), torch.tensor([0, 2, 3, 3]))
    rates = acceptance(blocks, 3)
    assert rates["survival_rate"] == [0.75, 0.75, 0.5]
    assert rates["accept_rate"] == pytest.approx([3 / 4, 3 / 3, 2 / 3])
    assert acceptance((torch.zeros(2, 2), torch.tensor([0, 0])), 2)["accept_rate"] == [0.0, None]  # none reached 2


def _miscalibrated(n: int, seed: int, stored: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Recorded confidences sigmoid(logit / stored_k), while draft k truly survives with sigmoid(logit / true_k)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, K, generator=g, dtype=torch.float64) * 2 + 1
    alive = torch.rand(n, K, generator=g, dtype=torch.float64) < torch.sigmoid(logits / torch.tensor([3.0, 0.5, 2, 1]))
    return torch.sigmoid(logits / torch.tensor(stored)), torch.cumprod(alive.long(), dim=1).sum(1)


def test_temperatures_fitted_on_held_out_blocks_calibrate_new_ones() -> None:
    stored = [1.5, 1.0, 0.8, 1.0]
    held_out = _miscalibrated(20000, seed=0, stored=stored)
    scaling = (stored, [0.0] * K)
    fitted = fit_sts(logits_from_confidences(held_out[0], stored), survival_outcomes(held_out[1], K))
    scored = calibration(_miscalibrated(20000, seed=1, stored=stored), scaling, fitted)
    assert scored["num_blocks"] == 20000
    assert scored["ece_after"] < 0.02 < 0.05 < scored["ece_before"]
    assert scored["brier_after"] < scored["brier_before"]
    assert 0.5 < scored["auroc_after"] < 1 and 0.5 < scored["auroc_before"] < 1
    empty = calibration((torch.zeros(0, K), torch.zeros(0, dtype=torch.long)), scaling, fitted)
    assert empty["ece_after"] is None and empty["auroc_after"] is None


def test_gzipped_prompt_files_read_as_plain_ones(tmp_path: Path) -> None:
    plain, zipped = _jsonl(tmp_path / "a.jsonl", PROMPTS), _jsonl(tmp_path / "b.jsonl.gz", PROMPTS)
    assert read_jsonl_prompts(zipped) == read_jsonl_prompts(plain) == PROMPTS


# ---- end to end ---------------------------------------------------------------------------------------------------


def test_rows_per_dataset_and_temperature_match_the_trace(tmp_path: Path, tiny: str, drafter: Path) -> None:
    trace_path = tmp_path / "trace.jsonl"
    datasets = {"first": PROMPTS[:2], "second": PROMPTS[2:]}
    result = evaluate_drafter(ENGINE | {"model": tiny}, drafter, datasets, max_tokens=16, trace_path=trace_path)
    rows = result["rows"]
    assert [(r["dataset"], r["temperature"]) for r in rows] == [
        ("first", 1.0),
        ("first", 0.0),
        ("second", 1.0),
        ("second", 0.0),
    ]
    identity = {"sampling_temperature": 1.0, "temperatures": [1.0] * K, "biases": [0.0] * K}
    assert result["calibration"]["source"] == "stored" and result["calibration"]["stored"] == [identity]
    for r in rows:
        assert r["num_prompts"] == 2 and r["num_output_tokens"] > 0 and r["num_drafts"] > 0
        assert r["tau"] == 1 + r["num_accepted_tokens"] / r["num_drafts"] >= 1
        assert all(a is None or 0 <= a <= 1 for a in r["accept_rate"] + r["survival_rate"])
    # vLLM's counting: one draft per request and verification step, which is one trace record.
    records = [q for s in load_trace(trace_path).streams.values() for q in s]
    assert load_trace(trace_path).K == K and sum(r["num_drafts"] for r in rows) == len(records)
    assert sum(r["num_accepted_tokens"] for r in rows) == sum(b.accepted for b in records)
    assert {b.temperature for b in records} == {0.0, 1.0}  # each block's request's, for undoing its calibration
    pooled = result["pooled_temperature_1"]
    assert 0 < pooled["num_blocks"] == sum(r["num_blocks"] for r in rows if r["temperature"] == 1)
    assert markdown_table(result).count("\n| first |") == 2

    # That trace, held out for a new evaluation: STS is fitted on its fully verified blocks.
    again = evaluate_drafter(
        ENGINE | {"model": tiny}, drafter, {"x": PROMPTS[:1]}, (1.0,), 8, calibration_trace=trace_path
    )
    num_full = sum(b.num_drafts == K for b in records)
    assert again["calibration"]["source"] == f"trace {trace_path}" and again["calibration"]["num_blocks"] == num_full
    # One fit per temperature the trace recorded.
    fitted = again["calibration"]["fitted"]
    assert [f["sampling_temperature"] for f in fitted] == [0.0, 1.0]
    assert all(f["temperatures"] != [1.0] * K or f["biases"] != [0.0] * K for f in fitted)


def test_eval_drafter_command_writes_json_plot_and_table(
    tmp_path: Path, tiny: str, drafter: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    argv = ["eval-drafter", str(drafter), "--model", tiny, *CLI_ENGINE, "--max-tokens", "16", "--num-prompts", "2"]
    argv += ["--dataset", str(_jsonl(tmp_path / "gsm.jsonl", PROMPTS)), "--dataset"]
    argv += [str(_jsonl(tmp_path / "code.jsonl.gz", PROMPTS[::-1])), "--temperature", "1.0"]
    argv += ["--calibration-dataset", str(_jsonl(tmp_path / "held_out.jsonl", [f"Say {w}." for w in "abcdef"]))]
    argv += ["--output-json", str(out / "eval.json"), "--output-plot", str(out / "rel.png")]
    assert main([*argv, "--output-md", str(out / "eval.md")]) == 0
    table = capsys.readouterr().out
    assert "| gsm | 1 | 2 |" in table and "| code | 1 | 2 |" in table and "held-out prompts" in table
    result = json.loads((out / "eval.json").read_text())
    assert [r["dataset"] for r in result["rows"]] == ["gsm", "code"]
    assert result["calibration"]["source"] == "held-out prompts" and result["calibration"]["num_blocks"] > 0
    assert (out / "rel.png").read_bytes()[:4] == b"\x89PNG"
    assert table.strip() in (out / "eval.md").read_text()


def test_calibrate_drafter_command_records_and_fits(
    tmp_path: Path, tiny: str, drafter: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    held_out = _jsonl(tmp_path / "held_out.jsonl", PROMPTS)
    argv = ["calibrate-drafter", str(drafter), "--model", tiny, *CLI_ENGINE, "--dataset", str(held_out)]
    assert main([*argv, "--max-tokens", "16", "--temperature", "0", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [f["sampling_temperature"] for f in report["fits"]] == [0.0, 1.0]
    for fit in report["fits"]:
        assert fit["num_blocks"] > 0 and len(fit["temperatures"]) == K
        assert fit["ece_after"] <= fit["ece_before"]
    stored = DSparkConfig.from_json(json.loads((drafter / "config.json").read_text()), "test").sts_by_temperature
    assert stored is not None
    assert [(e.sampling_temperature, list(e.temperatures)) for e in stored] == [
        (f["sampling_temperature"], f["temperatures"]) for f in report["fits"]
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-prompts", "0"], "num_prompts=0 is invalid"),
        (["--dataset", "missing.jsonl"], "dataset='missing.jsonl' is invalid"),
        (["--temperature", "0", "--output-plot", "x.png"], "needs temperature 1"),
        (["--speculative-config", "{}"], "speculative_config="),
    ],
)
def test_eval_drafter_rejects_bad_arguments(
    flags: list[str], message: str, tmp_path: Path, drafter: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = str(_jsonl(tmp_path / "d.jsonl", PROMPTS))
    assert main(["eval-drafter", str(drafter), "--dataset", data, *flags]) == 2
    assert message in capsys.readouterr().err
    assert main(["eval-drafter", str(tmp_path / "nowhere"), "--dataset", data]) == 2
    assert "drafter_dir=" in capsys.readouterr().err
