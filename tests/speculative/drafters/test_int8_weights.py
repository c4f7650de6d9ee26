"""int8 drafter weights (dspark/speculative/drafters/dspark/int8.py), CPU:

- quantize: |q| <= 127, each row's largest weight maps to +-127, the error is at most half a step, zero rows stay 0;
- a checkpoint written with int8 weights loads as exactly the float drafter whose weights are the dequantized ones,
  in the engine as well;
- benchmarks/drafter/export.py --int8 writes such a checkpoint, well under the bf16 export's size, and exporting it
  again changes nothing.
(Damaged int8 files: test_bad_drafter_files.py.)
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.models.config import ModelConfig
from dspark.models.loader import load_config
from dspark.speculative.drafters.dspark import int8
from dspark.speculative.drafters.dspark.checkpoint import WEIGHTS, load_drafter, random_drafter, save_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig

REPO = Path(__file__).resolve().parents[3]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target_config(tiny_model_dirs: dict[str, Path]) -> ModelConfig:
    return load_config(tiny_model_dirs["llama"])


@pytest.fixture(scope="module")
def float_drafter(tmp_path_factory: pytest.TempPathFactory, target_config: ModelConfig) -> Path:
    cfg = DSparkConfig.for_target(target_config, block_size=4, num_taps=1, markov_rank=16)
    model = random_drafter(cfg, seed=3)
    with torch.no_grad():  # weights of the scale training gives them, with some rows all zero
        for p in model.parameters():
            if p.dim() == 2 and p.shape[0] > 1:
                p.normal_(0.0, 0.05)
                p[1].zero_()
    return save_drafter(model, tmp_path_factory.mktemp("float") / "drafter")


def test_quantize_rounds_each_row_to_its_own_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 300, generator=gen) * torch.logspace(-4, 1, 37)[:, None]
    w[5] = 0.0
    w[9, 7] = -3.0  # a row whose largest magnitude is negative
    q, scale = int8.quantize(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (37,)
    assert int(q.abs().max()) == 127
    rows = [i for i in range(37) if i != 5]
    assert (q[rows].abs().amax(dim=1) == 127).all()
    assert q[9, 7] == -127 and (q[5] == 0).all() and scale[5] == 0
    deq = int8.dequantize(q, scale, torch.float32)
    assert (deq[5] == 0).all()
    err = (deq - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5) + 1e-12).all()


def test_quantize_state_keeps_small_and_one_dimensional_tensors() -> None:
    state = {
        "fc.weight": torch.randn(64, 128),
        "norm.weight": torch.randn(64),
        "confidence_head.proj.weight": torch.randn(1, 72),  # under MIN_ELEMENTS
        "markov_head.markov_w1.weight": torch.randn(49152, 4),  # a scale per 4 weights would save nothing
        "ids": torch.arange(8192).reshape(64, 128),  # not floating point
    }
    out = int8.quantize_state(state)
    assert set(out) == {*state, "fc.weight_scale"}
    assert out["fc.weight"].dtype == torch.int8
    for name in ("norm.weight", "confidence_head.proj.weight", "markov_head.markov_w1.weight", "ids"):
        assert out[name] is state[name]


def _write_int8(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    save_file(int8.quantize_state(load_file(str(src / WEIGHTS))), str(dst / WEIGHTS))
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    return dst


def test_an_int8_checkpoint_loads_as_its_dequantized_float_drafter(
    tmp_path: Path, float_drafter: Path, target_config: ModelConfig
) -> None:
    quantized = _write_int8(float_drafter, tmp_path / "int8")
    stored = load_file(str(quantized / WEIGHTS))
    expected = load_file(str(float_drafter / WEIGHTS))
    for name in list(expected):
        if name + int8.SCALE_SUFFIX in stored:
            expected[name] = int8.dequantize(stored[name], stored[name + int8.SCALE_SUFFIX], torch.float32)
    assert sum(n.endswith(int8.SCALE_SUFFIX) for n in stored) >= 8  # the layers' projections, fc, the Markov head

    loaded = load_drafter(quantized, target_config, torch.float32, CPU)
    reference = load_drafter(float_drafter, target_config, torch.float32, CPU)
    reference.load_state_dict(expected)
    ours, theirs = loaded.state_dict(), reference.state_dict()
    assert set(ours) == set(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    changed = [n for n in ours if not torch.equal(ours[n], load_file(str(float_drafter / WEIGHTS))[n])]
    assert "markov_head.markov_w2.weight" in changed and "fc.weight" in changed  # it did quantize


def test_an_int8_drafter_drafts_as_its_dequantized_float_drafter(
    tmp_path: Path, float_drafter: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    """Through the engine: both engines hold the same drafter weights and give the same tokens, greedy and seeded."""
    from dspark import LLM, SamplingParams

    quantized = _write_int8(float_drafter, tmp_path / "int8")
    tensors = int8.dequantize_state(load_file(str(quantized / WEIGHTS)))
    dequantized = tmp_path / "dequantized"
    dequantized.mkdir()
    save_file(tensors, str(dequantized / WEIGHTS))
    (dequantized / "config.json").write_bytes((float_drafter / "config.json").read_bytes())

    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    params = [SamplingParams(max_tokens=12, temperature=0.0), SamplingParams(max_tokens=12, temperature=1.0, seed=5)]
    runs = []
    for drafter in (quantized, dequantized):
        spec = {"method": "dspark", "model": str(drafter), "enable_adaptive_verification": False}
        llm = LLM(
            model=str(tiny_model_dirs["llama"]), dtype="float32", num_kv_blocks=64, max_model_len=128,
            speculative_config=spec,
        )  # fmt: skip
        outs = llm.generate(prompts, params)
        assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0
        runs.append(([o.outputs[0].token_ids for o in outs], llm.engine.dspark_model.state_dict()))
    (tokens_a, weights_a), (tokens_b, weights_b) = runs
    assert tokens_a == tokens_b
    assert all(torch.equal(weights_a[n], weights_b[n]) for n in weights_b)


def _export(src: Path, dst: Path, *flags: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    script = str(REPO / "benchmarks/drafter/export.py")
    run = subprocess.run([sys.executable, script, str(src), str(dst), *flags], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_export_int8_shrinks_the_checkpoint_and_is_idempotent(
    tmp_path: Path, float_drafter: Path, target_config: ModelConfig
) -> None:
    _export(float_drafter, tmp_path / "bf16")
    _export(float_drafter, tmp_path / "a", "--int8")
    _export(tmp_path / "a", tmp_path / "b", "--int8")
    size = {d: sum(f.stat().st_size for f in (tmp_path / d).glob("*.safetensors")) for d in ("bf16", "a", "b")}
    # The tiny drafter's rank-16 Markov head pays a 4-byte scale per 16 weights; the shipped one's, per 32.
    assert size["a"] < 0.7 * size["bf16"] < 0.4 * (float_drafter / WEIGHTS).stat().st_size
    a, b = load_file(str(tmp_path / "a" / WEIGHTS)), load_file(str(tmp_path / "b" / WEIGHTS))
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    model = load_drafter(tmp_path / "b", target_config, torch.bfloat16, CPU)
    assert next(model.parameters()).dtype == torch.bfloat16
    cfg = load_drafter(float_drafter, target_config, torch.float32, CPU).config
    assert dataclasses.asdict(model.config) == dataclasses.asdict(cfg)
