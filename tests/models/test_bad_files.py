"""Every damaged or unsupported model file gives a ModelLoadError that names the file and the problem.

pytest.raises(ModelLoadError) lets any other exception type through, so a raw ValueError or KeyError fails the test.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dspark.errors import ModelLoadError
from dspark.models.loader import load_model

CPU = torch.device("cpu")
HIDDEN, INTERMEDIATE, VOCAB, HEADS, KV_HEADS, LAYERS = 32, 64, 16, 4, 2, 2
KV_DIM = HIDDEN // HEADS * KV_HEADS


def load_error(path: Path, names: Path | None = None) -> str:
    """load_model(path) must raise ModelLoadError naming `names` (default: path); returns the message."""
    with pytest.raises(ModelLoadError) as info:
        load_model(path, torch.float32, CPU)
    message = str(info.value)
    assert str(names or path) in message, f"the message does not name {names or path}: {message}"
    return message


# --- GGUF ----------------------------------------------------------------------------------------------------------

GGUF_SHAPES = {  # numpy (row-major, Hugging Face) shapes; the file stores them reversed
    "token_embd.weight": (VOCAB, HIDDEN),
    "output_norm.weight": (HIDDEN,),
    "output.weight": (VOCAB, HIDDEN),
    **{
        f"blk.{i}.{name}.weight": shape
        for i in range(LAYERS)
        for name, shape in {
            "attn_norm": (HIDDEN,),
            "ffn_norm": (HIDDEN,),
            "attn_q": (HIDDEN, HIDDEN),
            "attn_k": (KV_DIM, HIDDEN),
            "attn_v": (KV_DIM, HIDDEN),
            "attn_output": (HIDDEN, HIDDEN),
            "ffn_gate": (INTERMEDIATE, HIDDEN),
            "ffn_up": (INTERMEDIATE, HIDDEN),
            "ffn_down": (HIDDEN, INTERMEDIATE),
        }.items()
    },
}
GGUF_INT_KEYS = {
    "context_length": 64,
    "embedding_length": HIDDEN,
    "block_count": LAYERS,
    "feed_forward_length": INTERMEDIATE,
    "attention.head_count": HEADS,
    "attention.head_count_kv": KV_HEADS,
    "vocab_size": VOCAB,
}


def write_gguf(
    path: Path,
    arch: str = "llama",
    drop_keys: tuple[str, ...] = (),
    drop_tensors: tuple[str, ...] = (),
    shapes: dict[str, tuple[int, ...]] | None = None,
    meta: dict[str, int] | None = None,
) -> Path:
    """A tiny Llama-shaped GGUF; the arguments damage it in one way each."""
    writer = gguf.GGUFWriter(path, arch)
    if "general.architecture" in drop_keys:
        del writer.kv_data[0]["general.architecture"]
    for key, value in {**GGUF_INT_KEYS, **(meta or {})}.items():
        if key not in drop_keys:
            writer.add_uint32(f"{arch}.{key}", value)
    if "attention.layer_norm_rms_epsilon" not in drop_keys:
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    rng = np.random.default_rng(0)
    for name, shape in {**GGUF_SHAPES, **(shapes or {})}.items():
        if name not in drop_tensors:
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_valid_tiny_gguf_loads(tmp_path: Path) -> None:
    """The baseline every damaged file below is made from."""
    model = load_model(write_gguf(tmp_path / "ok.gguf"), torch.float32, CPU)
    assert model.config.num_layers == LAYERS and model.config.vocab_size == VOCAB


@pytest.mark.parametrize(
    "cut",
    [lambda b: b[: len(b) // 2], lambda b: b[:10], lambda b: b[:-100], lambda b: b""],
    ids=["half", "10-bytes", "last-100-bytes-missing", "empty"],
)
def test_truncated_gguf(tmp_path: Path, cut: Any) -> None:
    path = write_gguf(tmp_path / "model.gguf")
    path.write_bytes(cut(path.read_bytes()))
    assert "GGUF" in load_error(path)


@pytest.mark.parametrize(
    "data", [bytes(range(256)) * 40, b"GGUF" + bytes(range(200))], ids=["garbage", "magic-then-garbage"]
)
def test_garbage_gguf(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(data)
    assert "GGUF" in load_error(path)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    message = load_error(write_gguf(tmp_path / "model.gguf", arch="gpt2"))
    assert "gpt2" in message and "llama" in message  # what it is and what is allowed


def test_gguf_without_architecture(tmp_path: Path) -> None:
    assert "architecture" in load_error(write_gguf(tmp_path / "model.gguf", drop_keys=("general.architecture",)))


@pytest.mark.parametrize(
    "key",
    [
        "context_length",
        "embedding_length",
        "block_count",
        "feed_forward_length",
        "attention.head_count",
        "attention.layer_norm_rms_epsilon",
    ],
)
def test_gguf_missing_required_metadata(tmp_path: Path, key: str) -> None:
    assert f"llama.{key}" in load_error(write_gguf(tmp_path / "model.gguf", drop_keys=(key,)))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_gguf_without_any_vocab_size(tmp_path: Path) -> None:
    # Neither llama.vocab_size nor tokenizer.ggml.tokens: the vocabulary size is unknown.
    assert "vocab_size" in load_error(write_gguf(tmp_path / "model.gguf", drop_keys=("vocab_size",)))


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    message = load_error(write_gguf(tmp_path / "model.gguf", drop_tensors=("blk.1.ffn_down.weight",)))
    assert "missing" in message and "model.layers.1.mlp.down_proj.weight" in message


def test_gguf_fewer_blocks_than_block_count(tmp_path: Path) -> None:
    message = load_error(write_gguf(tmp_path / "model.gguf", meta={"block_count": LAYERS + 1}))
    assert "missing" in message and f"model.layers.{LAYERS}." in message


@pytest.mark.parametrize(
    ("arch", "tensor", "shape"),
    [
        ("llama", "token_embd.weight", (VOCAB + 1, HIDDEN)),
        ("llama", "blk.0.ffn_up.weight", (INTERMEDIATE, HIDDEN + 1)),
        ("llama", "blk.0.attn_k.weight", (HIDDEN, HIDDEN)),  # q's shape where k's belongs: still divisible
        ("qwen2", "blk.0.attn_q.weight", (HIDDEN - 4, HIDDEN)),
        pytest.param(
            "llama",
            "blk.0.attn_q.weight",
            (HIDDEN - 4, HIDDEN),
        ),
        pytest.param("llama", "blk.1.attn_k.weight", (6, HIDDEN)),
    ],
    ids=["embd", "ffn_up", "llama-attn_k", "qwen2-attn_q", "llama-attn_q-odd-rows", "llama-attn_k-odd-rows"],
)
def test_gguf_tensor_wrong_shape(tmp_path: Path, arch: str, tensor: str, shape: tuple[int, ...]) -> None:
    message = load_error(write_gguf(tmp_path / "model.gguf", arch=arch, shapes={tensor: shape}))
    assert "shape" in message and str(shape) in message


@pytest.mark.parametrize(
    "meta",
    [
        pytest.param(
            {"attention.head_count_kv": 3},
        ),
        pytest.param(
            {"attention.head_count": 0},
        ),
    ],
    ids=["kv-heads-not-a-divisor", "zero-heads"],
)
def test_gguf_inconsistent_head_counts(tmp_path: Path, meta: dict[str, int]) -> None:
    assert "head" in load_error(write_gguf(tmp_path / "model.gguf", meta=meta))


# --- Hugging Face directories --------------------------------------------------------------------------------------


def hf_config() -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }


def hf_state_dict() -> dict[str, torch.Tensor]:
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        }
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def write_hf_dir(
    path: Path, config: dict[str, Any] | None = None, state: dict[str, torch.Tensor] | None = None
) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config() if config is None else config))
    save_file(hf_state_dict() if state is None else state, str(path / "model.safetensors"))
    return path


def test_valid_tiny_hf_dir_loads(tmp_path: Path) -> None:
    """The baseline every damaged directory below is made from."""
    model = load_model(write_hf_dir(tmp_path / "hf"), torch.float32, CPU)
    assert torch.equal(model.state_dict()["lm_head.weight"], hf_state_dict()["lm_head.weight"])


def test_hf_dir_without_safetensors(tmp_path: Path) -> None:
    path = write_hf_dir(tmp_path / "hf")
    (path / "model.safetensors").unlink()
    assert "safetensors" in load_error(path)


def test_hf_dir_without_config(tmp_path: Path) -> None:
    path = write_hf_dir(tmp_path / "hf")
    (path / "config.json").unlink()
    assert "config.json" in load_error(path)


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],
        lambda b: b[:10],
        lambda b: b"",
        lambda b: bytes(range(256)) * 8,
        lambda b: (10**9).to_bytes(8, "little") + b[8:],  # header length far beyond the file
    ],
    ids=["half", "10-bytes", "empty", "garbage", "huge-header-length"],
)
def test_hf_corrupt_safetensors(tmp_path: Path, damage: Any) -> None:
    path = write_hf_dir(tmp_path / "hf")
    file = path / "model.safetensors"
    file.write_bytes(damage(file.read_bytes()))
    assert "safetensors" in load_error(path, names=file)


@pytest.mark.parametrize(
    "content",
    [
        b"{ this is not json",
        b"",
        pytest.param(
            b"\xff\xfe\x00\x80garbage",
        ),
        pytest.param(
            b"[1, 2, 3]",
        ),
    ],
    ids=["broken-json", "empty", "not-utf8", "json-list"],
)
def test_hf_config_not_json_object(tmp_path: Path, content: bytes) -> None:
    path = write_hf_dir(tmp_path / "hf")
    (path / "config.json").write_bytes(content)
    assert "config.json" in load_error(path)


def test_hf_unsupported_architecture(tmp_path: Path) -> None:
    message = load_error(write_hf_dir(tmp_path / "hf", config={**hf_config(), "architectures": ["GPT2LMHeadModel"]}))
    assert "GPT2LMHeadModel" in message and "LlamaForCausalLM" in message


@pytest.mark.parametrize(
    "key", ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
)
def test_hf_config_missing_key(tmp_path: Path, key: str) -> None:
    config = hf_config()
    del config[key]
    assert key in load_error(write_hf_dir(tmp_path / "hf", config=config))


def test_hf_config_without_architectures(tmp_path: Path) -> None:
    config = hf_config()
    del config["architectures"]
    assert "architecture" in load_error(write_hf_dir(tmp_path / "hf", config=config))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        pytest.param(
            "hidden_size",
            "big",
        ),
        pytest.param(
            "num_key_value_heads",
            3,
        ),
        pytest.param(
            "num_attention_heads",
            0,
        ),
    ],
    ids=["non-integer", "kv-heads-not-a-divisor", "zero-heads"],
)
def test_hf_config_invalid_value(tmp_path: Path, key: str, value: Any) -> None:
    assert key in load_error(write_hf_dir(tmp_path / "hf", config={**hf_config(), key: value}))


def test_hf_missing_layer_weight(tmp_path: Path) -> None:
    state = hf_state_dict()
    del state["model.layers.1.self_attn.v_proj.weight"]
    message = load_error(write_hf_dir(tmp_path / "hf", state=state))
    assert "missing" in message and "model.layers.1.self_attn.v_proj.weight" in message


def test_hf_missing_lm_head_when_untied(tmp_path: Path) -> None:
    state = hf_state_dict()
    del state["lm_head.weight"]
    assert "lm_head.weight" in load_error(write_hf_dir(tmp_path / "hf", state=state))


def test_hf_unexpected_tensor(tmp_path: Path) -> None:
    state = hf_state_dict()
    state[f"model.layers.{LAYERS}.mlp.up_proj.weight"] = torch.zeros(INTERMEDIATE, HIDDEN)  # one layer too many
    message = load_error(write_hf_dir(tmp_path / "hf", state=state))
    assert "unexpected" in message and f"model.layers.{LAYERS}.mlp.up_proj.weight" in message


def test_hf_shape_mismatch(tmp_path: Path) -> None:
    state = hf_state_dict()
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(INTERMEDIATE + 1, HIDDEN)
    message = load_error(write_hf_dir(tmp_path / "hf", state=state))
    assert "model.layers.0.mlp.up_proj.weight" in message
    assert str((INTERMEDIATE + 1, HIDDEN)) in message and str((INTERMEDIATE, HIDDEN)) in message


class _TouchOnUnpickle:
    """Unpickling this runs Path.touch(marker): proof that the loader unpickled the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_hf_pytorch_bin_is_never_unpickled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_hf_dir(tmp_path / "hf")
    (path / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (path / "pytorch_model.bin").write_bytes(pickle.dumps(_TouchOnUnpickle(marker)))

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.load called on a model file")

    monkeypatch.setattr(torch, "load", refuse)
    message = load_error(path)
    assert not marker.exists()
    assert "safetensors" in message and "GGUF" in message
