"""A damaged drafter, or one made for another target, stops LLM(speculative_config={"method": "dspark", ...}) with a
ModelLoadError that names the file (or the directory, where no one file is at fault) and the problem.

pytest.raises(ModelLoadError) lets any other exception type through, so a raw KeyError, RuntimeError, struct error or
allocation failure fails the test. Every case damages one copy of a good drafter in one way. The cases in
VIA_THE_ENGINE build the whole engine (LLM); the rest call load_drafter as the engine does (with the target's config),
which skips the ~0.4 s of loading the target and tokenizer per case. (Damaged target files:
tests/models/test_bad_files.py; load_drafter's own cases: tests/speculative/drafters/test_dspark_drafter.py.)
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark import LLM, ModelLoadError
from dspark.models.config import ModelConfig
from dspark.models.loader import load_config
from dspark.speculative.drafters.dspark import int8
from dspark.speculative.drafters.dspark.checkpoint import load_drafter, random_drafter, save_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig

WEIGHTS, CONFIG = "model.safetensors", "config.json"


@pytest.fixture(scope="module")
def target(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]  # 2 layers, hidden 64, SmolLM2's 49152-token vocabulary


@pytest.fixture(scope="module")
def target_config(target: Path) -> ModelConfig:
    return load_config(target)


def drafter_config(target_config: ModelConfig, **changes: Any) -> DSparkConfig:
    cfg = DSparkConfig.for_target(target_config, block_size=4, num_taps=1, markov_rank=4)
    return dataclasses.replace(cfg, **changes)


@pytest.fixture(scope="module")
def good_drafter(tmp_path_factory: pytest.TempPathFactory, target_config: ModelConfig) -> Path:
    return save_drafter(random_drafter(drafter_config(target_config)), tmp_path_factory.mktemp("good") / "drafter")


def build(target: Path, drafter: Path) -> LLM:
    spec = {"method": "dspark", "model": str(drafter), "enable_adaptive_verification": False}
    return LLM(model=str(target), dtype="float32", num_kv_blocks=64, max_model_len=128, speculative_config=spec)


# One case of each kind of damage goes through the whole engine.
VIA_THE_ENGINE = {"half", "missing", "hidden_size-a-string", "huge-width", "vocabulary", "hidden-size"}


def load_error(target: Path, drafter: Path, names: Path, case: str) -> str:
    """Loading the drafter must raise ModelLoadError naming `names`; returns the message."""
    with pytest.raises(ModelLoadError) as info:
        if case in VIA_THE_ENGINE:
            build(target, drafter)
        else:
            load_drafter(drafter, load_config(target), torch.float32, torch.device("cpu"))
    message = str(info.value)
    assert f"{names}: " in message, f"the message does not name {names}: {message}"
    return message


def test_the_good_drafter_loads(target: Path, good_drafter: Path) -> None:
    """The baseline every damaged copy below is made from."""
    llm = build(target, good_drafter)
    assert llm.engine.dspark_model is not None and llm.engine.num_spec_tokens == 4


# ---- model.safetensors -------------------------------------------------------------------------------------------


def _header(data: bytes) -> dict[str, Any]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


def _with_header(data: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """The file with its JSON header edited (the tensor bytes after it unchanged)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = _header(data)
    edit(header)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


def _first_tensor(header: dict[str, Any]) -> dict[str, Any]:
    return header[next(k for k in sorted(header) if k != "__metadata__")]


CORRUPT_WEIGHTS: dict[str, Callable[[bytes], bytes]] = {
    "half": lambda b: b[: len(b) // 2],
    "last-byte-missing": lambda b: b[:-1],
    "10-bytes": lambda b: b[:10],
    "inside-the-length": lambda b: b[:5],
    "empty": lambda b: b"",
    "garbage": lambda b: bytes(range(256)) * 16,
    "huge-header-length": lambda b: (10**9).to_bytes(8, "little") + b[8:],
    "header-not-json": lambda b: b[:8] + b"\xff" * (len(b) - 8),
    "unknown-dtype": lambda b: _with_header(b, lambda h: _first_tensor(h).update(dtype="F33")),
    "offsets-past-the-end": lambda b: _with_header(b, lambda h: _first_tensor(h).update(data_offsets=[0, 10**9])),
    "offsets-disagree-with-shape": lambda b: _with_header(
        b, lambda h: _first_tensor(h).update(shape=[s * 2 for s in _first_tensor(h)["shape"]])
    ),
}


@pytest.mark.parametrize("damage", list(CORRUPT_WEIGHTS))
def test_corrupt_weights(tmp_path: Path, target: Path, good_drafter: Path, damage: str) -> None:
    drafter = shutil.copytree(good_drafter, tmp_path / "drafter")
    file = drafter / WEIGHTS
    file.write_bytes(CORRUPT_WEIGHTS[damage](file.read_bytes()))
    assert "not a readable safetensors file" in load_error(target, drafter, file, damage)


def test_no_weights(tmp_path: Path, target: Path, good_drafter: Path) -> None:
    drafter = shutil.copytree(good_drafter, tmp_path / "drafter")
    (drafter / WEIGHTS).unlink()
    assert "no *.safetensors files" in load_error(target, drafter, drafter, "")


def _edit_tensors(drafter: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    tensors = load_file(str(drafter / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(drafter / WEIGHTS))


def _int8_fc(scale: Callable[[torch.Tensor], torch.Tensor] | None) -> Callable[[dict[str, torch.Tensor]], object]:
    """Store fc.weight as int8, with its scales edited by `scale` (None: no scales at all)."""

    def edit(ts: dict[str, torch.Tensor]) -> None:
        q, s = int8.quantize(ts["fc.weight"])
        ts["fc.weight"] = q
        if scale is not None:
            ts["fc.weight_scale"] = scale(s)

    return edit


TENSOR_DAMAGE: dict[str, tuple[Callable[[dict[str, torch.Tensor]], object], str, str]] = {
    # name: (edit the tensors; "" if the error names the directory (no one file is at fault), else the file; problem)
    "missing": (lambda ts: ts.pop("layers.0.self_attn.o_proj.weight"), "", "missing tensors layers.0.self_attn"),
    "unexpected": (lambda ts: ts.update({"lm_head.weight": torch.zeros(4, 64)}), WEIGHTS, "unexpected tensors lm_head"),
    "wrong-shape": (
        lambda ts: ts.update({"layers.0.mlp.up_proj.weight": torch.zeros(64, 64)}),
        WEIGHTS,
        r"'layers.0.mlp.up_proj.weight' has shape \(64, 64\), the config implies \(128, 64\)",
    ),
    "1-d-where-2-d": (
        lambda ts: ts.update({"fc.weight": torch.zeros(64)}),
        WEIGHTS,
        r"'fc.weight' has shape \(64,\), the config implies \(64, 64\)",
    ),
    "integer-weights": (
        lambda ts: ts.update({"norm.weight": torch.ones(64, dtype=torch.int32)}),
        WEIGHTS,
        "'norm.weight' has dtype torch.int32; weights are floating point",
    ),
    "int8-without-scales": (_int8_fc(None), WEIGHTS, "'fc.weight' is int8 without 'fc.weight_scale'"),
    "scales-of-nothing": (
        lambda ts: ts.update({"lm_head.weight_scale": torch.ones(4)}),
        WEIGHTS,
        "'lm_head.weight_scale' scales 'lm_head.weight', which no file holds",
    ),
    "scales-of-a-float-weight": (
        lambda ts: ts.update({"fc.weight_scale": torch.ones(64)}),
        WEIGHTS,
        "'fc.weight_scale' scales 'fc.weight', which has dtype torch.float32; scales go with int8 weights",
    ),
    "scales-too-few": (
        _int8_fc(lambda s: s[:3]),
        WEIGHTS,
        r"'fc.weight_scale' has shape \(3,\); 'fc.weight' \(64, 64\) needs one per row",
    ),
    "scales-integer": (_int8_fc(lambda s: s.to(torch.int32)), WEIGHTS, "scales are floating point"),
    "scales-negative": (_int8_fc(lambda s: -s), WEIGHTS, "holds a negative or non-finite scale"),
    "scales-nan": (_int8_fc(lambda s: s.index_fill(0, torch.tensor([2]), float("nan"))), WEIGHTS, "non-finite"),
}


@pytest.mark.parametrize("damage", list(TENSOR_DAMAGE))
def test_damaged_tensors(tmp_path: Path, target: Path, good_drafter: Path, damage: str) -> None:
    edit, named, problem = TENSOR_DAMAGE[damage]
    drafter = shutil.copytree(good_drafter, tmp_path / "drafter")
    _edit_tensors(drafter, edit)
    assert re.search(problem, load_error(target, drafter, drafter / named if named else drafter, damage))


# ---- config.json -------------------------------------------------------------------------------------------------


def _set(key: str, value: Any, nested: bool = False) -> Callable[[dict[str, Any]], None]:
    return lambda c: (c["dspark_config"] if nested else c).__setitem__(key, value)


CONFIG_DAMAGE: dict[str, tuple[Callable[[dict[str, Any]], object] | bytes, str]] = {
    # name: (the new file's bytes, or an edit of its JSON; the problem the error states)
    "broken-json": (b'{"hidden_size": 64,', "cannot be read"),
    "empty": (b"", "cannot be read"),
    "not-utf8": (b"\xff\xfe\x00\x80{}", "cannot be read"),
    "a-list": (b"[1, 2]", "must hold a JSON object"),
    "lacks-vocab_size": (lambda c: c.pop("vocab_size"), "lacks the key 'vocab_size'"),
    "lacks-block_size": (lambda c: c.pop("block_size"), "lacks the key 'block_size'"),
    "hidden_size-a-string": (_set("hidden_size", "64"), "hidden_size='64' is invalid: must be an integer >= 1"),
    "hidden_size-a-float": (_set("hidden_size", 64.5), "hidden_size=64.5 is invalid: must be an integer"),
    "block_size-a-bool": (_set("block_size", True), "block_size=True is invalid: must be an integer"),
    "zero-heads": (_set("num_attention_heads", 0), "num_attention_heads=0 is invalid: must be an integer >= 1"),
    "heads-not-a-multiple": (_set("num_key_value_heads", 3), "num_attention_heads=4 is not a multiple of 3"),
    "infinite-width": (_set("intermediate_size", float("inf")), "intermediate_size=inf is invalid"),
    "rms_norm_eps-a-list": (_set("rms_norm_eps", [1e-5]), "rms_norm_eps=\\[1e-05\\] is invalid: must be a positive"),
    "rope_parameters-a-string": (
        lambda c: (c.pop("rope_theta"), c.update(rope_parameters="yarn")),
        "rope_parameters='yarn' is invalid: must be a JSON object",
    ),
    "dspark_config-a-list": (_set("dspark_config", [1]), r"dspark_config=\[1\] is invalid: must be a JSON object"),
    "layer-ids-a-string": (
        _set("target_layer_ids", "1", nested=True),
        "target_layer_ids='1' is invalid: must be a list of layer indices",
    ),
    "negative-layer-id": (_set("target_layer_ids", [-1], nested=True), r"target_layer_ids=\[-1\] is invalid"),
    "confidence_head-a-string": (
        _set("confidence_head", "false", nested=True),
        "confidence_head='false' is invalid: must be true or false",
    ),
    "sts_temperatures-wrong-length": (_set("sts_temperatures", [1.0], nested=True), "sts_temperatures has 1 values"),
    "sts_temperatures-not-numbers": (
        _set("sts_temperatures", ["hot"] * 4, nested=True),
        "sts_temperatures=\\['hot'.* is invalid: must be a list of positive finite numbers",
    ),
    "sts_by_temperature-beside-sts_temperatures": (
        lambda c: c["dspark_config"].update(
            sts_temperatures=[1.0] * 4,
            sts_by_temperature=[{"sampling_temperature": 0, "temperatures": [1.0] * 4, "biases": [0.0] * 4}],
        ),
        "sts_by_temperature replaces sts_temperatures and sts_biases",
    ),
    "sts_by_temperature-an-entry-without-biases": (
        _set("sts_by_temperature", [{"sampling_temperature": 0, "temperatures": [1.0] * 4}], nested=True),
        r"sts_by_temperature\[0\]=.* is invalid: must be a non-empty list of \{sampling_temperature",
    ),
    "sts_by_temperature-a-negative-temperature": (
        _set(
            "sts_by_temperature",
            [{"sampling_temperature": -1, "temperatures": [1.0] * 4, "biases": [0.0] * 4}],
            nested=True,
        ),
        r"sts_by_temperature\[0\].sampling_temperature=-1 is invalid: must be a finite number >= 0",
    ),
    "sts_by_temperature-one-temperature-twice": (
        _set(
            "sts_by_temperature",
            [{"sampling_temperature": 1, "temperatures": [1.0] * 4, "biases": [0.0] * 4}] * 2,
            nested=True,
        ),
        "one fit per temperature",
    ),
    "mask_token_id-past-the-vocabulary": (
        _set("mask_token_id", 49152, nested=True),
        "mask_token_id=49152 is not in the vocabulary",
    ),
    # Sizes far beyond the file's tensors: a shape error from the weights file, not an attempt to allocate them.
    "huge-width": (_set("intermediate_size", 10**12), r"the config implies \(1000000000000, 64\)"),
}


@pytest.mark.parametrize("damage", list(CONFIG_DAMAGE))
def test_damaged_config(tmp_path: Path, target: Path, good_drafter: Path, damage: str) -> None:
    change, problem = CONFIG_DAMAGE[damage]
    drafter = shutil.copytree(good_drafter, tmp_path / "drafter")
    file = drafter / CONFIG
    if isinstance(change, bytes):
        file.write_bytes(change)
    else:
        raw = json.loads(file.read_text())
        change(raw)
        file.write_text(json.dumps(raw))
    names = drafter / WEIGHTS if damage == "huge-width" else file
    assert re.search(problem, load_error(target, drafter, names, damage))


def test_no_config(tmp_path: Path, target: Path, good_drafter: Path) -> None:
    drafter = shutil.copytree(good_drafter, tmp_path / "drafter")
    (drafter / CONFIG).unlink()
    with pytest.raises(ModelLoadError, match=re.escape(f"{drafter}: a model directory needs config.json")):
        build(target, drafter)


def test_no_drafter_directory(tmp_path: Path, target: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"neither a known alias .* nor an existing path"):
        build(target, tmp_path / "nowhere")


# ---- a drafter made for another target ---------------------------------------------------------------------------

ANOTHER_TARGET: dict[str, tuple[dict[str, Any], str]] = {
    "vocabulary": ({"vocab_size": 32000}, "vocab_size 32000 != the target's 49152"),
    "hidden-size": ({"hidden_size": 32, "head_dim": 8}, "hidden_size 32 != the target's 64"),
    "layer-count": ({"num_target_layers": 8, "target_layer_ids": (1, 5)}, "num_target_layers 8 != the target's 2"),
    # DFlash's configs do not record the target's depth: the tapped layers alone must fit it.
    "taps-past-the-last-layer": (
        {"num_target_layers": None, "target_layer_ids": (1, 5)},
        r"target_layer_ids \[1, 5\] reach past the target's layers",
    ),
}


@pytest.mark.parametrize("other", list(ANOTHER_TARGET))
def test_drafter_for_another_target(tmp_path: Path, target: Path, target_config: ModelConfig, other: str) -> None:
    changes, problem = ANOTHER_TARGET[other]
    drafter = save_drafter(random_drafter(drafter_config(target_config, **changes)), tmp_path / "drafter")
    message = load_error(target, drafter, drafter, other)
    assert "this drafter was made for another target" in message and re.search(problem, message)
