"""`dspark train-drafter` end to end at toy scale: prompt pool, the target's own answers, training, checkpoints,
resume, and a drafter the engine loads and speculates with (greedy output unchanged)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dspark import LLM, SamplingParams
from dspark.train.data import MBPP_TEST_IDS, load_sequences, prompt_pool
from dspark.train.driver import TrainConfig, train_drafter


def _data_dir(root: Path) -> Path:
    (root / "gsm8k").mkdir(parents=True)
    questions = [
        {"question": f"Tom has {i} apples and buys {i + 2} more. How many?", "answer": "#### 1"} for i in range(4)
    ]
    (root / "gsm8k" / "train.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(q) + "\n" for q in questions).encode())
    )
    (root / "mbpp").mkdir()
    rows = [{"task_id": t, "text": f"Write task {t}.", "test_list": [f"assert f({t}) == {t}"]} for t in (5, 20, 600)]
    (root / "mbpp" / "mbpp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "llamafactory").mkdir()
    (root / "llamafactory" / "c4_demo.jsonl").write_text(
        json.dumps({"text": "The river runs past the old mill " * 9}) + "\n"
    )
    return root


def test_the_prompt_pool_never_holds_evaluation_items(tmp_path: Path) -> None:
    pool = prompt_pool(_data_dir(tmp_path / "data"), per_source=10)
    sources = {p.source for p in pool}
    assert {"gsm8k-train", "mbpp-train", "c4", "python-stdlib"} <= sources
    mbpp = [p.text for p in pool if p.source == "mbpp-train"]
    assert sorted(mbpp) == [
        "Write task 5. Your code should pass this test: assert f(5) == 5",
        "Write task 600. Your code should pass this test: assert f(600) == 600",
    ]
    assert 20 in MBPP_TEST_IDS
    assert all(not p.chat for p in pool if p.source in ("c4", "python-stdlib"))


def test_train_checkpoint_resume_and_serve(tmp_path: Path, tiny_model_dirs: dict[str, Path]) -> None:
    model = str(tiny_model_dirs["llama"])
    llm = LLM(model=model, dtype="float32", max_model_len=256, num_kv_blocks=128)
    cfg = TrainConfig(
        data_dir=str(_data_dir(tmp_path / "data")),
        output_dir=str(tmp_path / "run"),
        num_layers=1,
        block_size=4,
        markov_rank=8,
        steps=6,
        lr=1e-3,
        blocks_per_sequence=4,
        prompts_per_source=2,
        max_tokens=24,
        checkpoint_every=3,
    )
    first = train_drafter(cfg, llm, progress=False)
    run = tmp_path / "run"
    assert [h["step"] for h in first["history"]] == [3, 6]
    assert json.loads((run / "state.json").read_text())["step"] == 6
    sequences = load_sequences(run / "sequences.jsonl")
    assert sequences and all(len(s.tokens) > s.num_prompt_tokens for s in sequences)
    with safe_open(str(run / "state.safetensors"), framework="pt") as f:
        assert any(k.endswith(".exp_avg_sq") for k in f.keys())

    resumed = train_drafter(TrainConfig(**{**cfg.__dict__, "steps": 9}), llm, progress=False)
    assert [h["step"] for h in resumed["history"]] == [9]  # continued from step 6, same sequences
    assert load_sequences(run / "sequences.jsonl") == sequences

    prompts = [[5, 6, 7, 8, 5, 6, 7], list(range(100, 140))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    spec = LLM(
        model=model,
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=128,
        speculative_config={"method": "dspark", "model": str(run / "drafter"), "enable_adaptive_verification": False},
    )
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == reference
    assert spec.get_metrics()["spec_decode_num_draft_tokens"] > 0


def test_init_from_fine_tunes_a_drafter_with_its_shape_and_without_its_calibration(
    tmp_path: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=256, num_kv_blocks=128)
    data = str(_data_dir(tmp_path / "data"))
    small = {"blocks_per_sequence": 4, "prompts_per_source": 2, "max_tokens": 24, "lr": 1e-3}
    base = TrainConfig(
        data_dir=data,
        output_dir=str(tmp_path / "base"),
        num_layers=1,
        block_size=4,
        markov_rank=8,
        steps=3,
        checkpoint_every=3,
        **small,
    )
    train_drafter(base, llm, progress=False)
    init = tmp_path / "base" / "drafter"
    raw = json.loads((init / "config.json").read_text())
    fit = {"temperatures": [2.0] * 4, "biases": [0.0] * 4}
    raw["dspark_config"]["sts_by_temperature"] = [{"sampling_temperature": t, **fit} for t in (0.0, 1.0)]  # calibrated
    (init / "config.json").write_text(json.dumps(raw))
    with safe_open(str(init / "model.safetensors"), framework="pt") as f:
        before = {k: f.get_tensor(k) for k in f.keys()}

    # Shape flags that disagree with the drafter: its own shape wins.
    tuned = TrainConfig(
        data_dir=data,
        output_dir=str(tmp_path / "tuned"),
        num_layers=3,
        block_size=6,
        markov_rank=0,
        steps=2,
        checkpoint_every=2,
        init_from=str(init),
        **small,
    )
    summary = train_drafter(tuned, llm, progress=False)
    assert [h["step"] for h in summary["history"]] == [2]  # a fresh schedule, not the base run's step 3
    out = json.loads((tmp_path / "tuned" / "drafter" / "config.json").read_text())
    assert out["num_hidden_layers"] == 1 and out["block_size"] == 4
    assert out["dspark_config"]["markov_rank"] == 8
    assert (
        out["dspark_config"].get("sts_temperatures") is None and out["dspark_config"].get("sts_by_temperature") is None
    )
    with safe_open(str(tmp_path / "tuned" / "drafter" / "model.safetensors"), framework="pt") as f:
        after = {k: f.get_tensor(k) for k in f.keys()}
    assert after.keys() == before.keys()
    assert any(not torch.equal(after[k], before[k]) for k in before)  # trained on from the init
    # Two Adam steps at lr 1e-3 move no weight by more than a few 1e-3.
    drift = max(float((after[k] - before[k]).abs().max()) for k in before if before[k].is_floating_point())
    assert drift < 0.05

    # --grow-layers: two identity layers on top of the init drafter's one, trained on from there.
    grown = TrainConfig(
        data_dir=data, output_dir=str(tmp_path / "grown"), steps=1, checkpoint_every=1, init_from=str(init),
        grow_layers=2, **small,
    )  # fmt: skip
    train_drafter(grown, llm, progress=False)
    assert json.loads((tmp_path / "grown" / "drafter" / "config.json").read_text())["num_hidden_layers"] == 3
    with safe_open(str(tmp_path / "grown" / "drafter" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) > set(before) and f.get_tensor("layers.2.mlp.down_proj.weight").abs().max() < 0.01


def test_no_source_is_a_clear_error(tmp_path: Path) -> None:
    from dspark.errors import ConfigError

    with pytest.raises(ConfigError, match="data_dir"):
        prompt_pool(tmp_path)


def test_the_command_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dspark.cli import main

    assert main(["train-drafter", "--data-dir", str(tmp_path / "none"), "--output-dir", str(tmp_path / "r")]) == 2
    assert "data_dir=" in capsys.readouterr().err
    args = ["train-drafter", "--data-dir", str(tmp_path), "--output-dir", str(tmp_path / "r"), "--steps", "0"]
    assert main(args) == 2
    assert "steps=0 is invalid" in capsys.readouterr().err
    args = ["train-drafter", "--data-dir", str(tmp_path), "--output-dir", str(tmp_path / "r")]
    assert main([*args, "--init-from", str(tmp_path / "nodrafter")]) == 2
    assert "init_from=" in capsys.readouterr().err
    assert main([*args, "--grow-layers", "2"]) == 2
    assert "grow_layers=2 is invalid: 0, or layers to add to the init_from drafter" in capsys.readouterr().err


def test_regenerate_skips_prompts_with_no_room_and_stops_at_the_deadline(tiny_model_dirs: dict[str, Path]) -> None:
    import time

    from dspark.train.data import Prompt, regenerate

    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=64, num_kv_blocks=64)
    prompts = [Prompt("t", "word " * 200, False), Prompt("t", "a short one", False), Prompt("t", "another", False)]
    done = regenerate(llm, prompts, samples_per_prompt=2, max_tokens=8)
    assert len(done) == 4  # the 200-word prompt (over max_model_len) is skipped, not an error
    assert all(len(s.tokens) - s.num_prompt_tokens == 8 or s.tokens[-1] == llm.tokenizer.eos_token_id for s in done)
    assert regenerate(llm, prompts, max_tokens=8, deadline=time.monotonic() - 1) == []  # past the deadline: nothing
    assert not llm.engine.has_unfinished_requests()  # what was queued was aborted, not left behind
