"""Only safetensors, GGUF and JSON are ever parsed: building engines from a Hugging Face directory and from a GGUF
(with a Hugging Face tokenizer), each with a DSpark drafter, and generating from them, never calls an unpickler.

pickle.load / pickle.loads, torch.load and numpy.load raise here; a loader that reached any of them (for a
pytorch_model.bin, a .pt drafter, a .npy table or a cached tokenizer) fails the test. (A target directory holding only
pytorch_model.bin: tests/models/test_bad_files.py.)
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.models.loader import load_config
from dspark.speculative.drafters.dspark.checkpoint import random_drafter, save_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(what: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            raise AssertionError(f"{what} called while loading or serving a model")

        return call

    monkeypatch.setattr(pickle, "load", refuse("pickle.load"))
    monkeypatch.setattr(pickle, "loads", refuse("pickle.loads"))
    monkeypatch.setattr(torch, "load", refuse("torch.load"))
    monkeypatch.setattr(np, "load", refuse("numpy.load"))


def _tiny_gguf(path: Path) -> Path:
    """A random 2-layer Llama GGUF with SmolLM2's vocabulary size (its tokenizer comes from a Hugging Face dir)."""
    hidden, inter, vocab, heads, kv_heads = 64, 128, 49152, 4, 2
    kv = hidden // heads * kv_heads
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in {
        "context_length": 256,
        "embedding_length": hidden,
        "block_count": 2,
        "feed_forward_length": inter,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "vocab_size": vocab,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(2):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (hidden, hidden),
            f"blk.{i}.attn_k.weight": (kv, hidden),
            f"blk.{i}.attn_v.weight": (kv, hidden),
            f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_gate.weight": (inter, hidden),
            f"blk.{i}.ffn_up.weight": (inter, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, inter),
        }
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        writer.add_tensor(name, (0.05 * rng.standard_normal(shape)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _drafter_for(target: Path, out: Path) -> Path:
    cfg = DSparkConfig.for_target(load_config(target), num_layers=1, block_size=3, num_taps=2, markov_rank=4)
    return save_drafter(random_drafter(cfg), out)


@pytest.mark.parametrize("kind", ["hf-dir", "gguf"])
def test_targets_and_drafters_load_without_unpickling(
    tmp_path: Path, tiny_model_dirs: dict[str, Path], kind: str, no_unpickling: None
) -> None:
    hf_dir = tiny_model_dirs["qwen3"]
    target = hf_dir if kind == "hf-dir" else _tiny_gguf(tmp_path / "tiny.gguf")
    drafter = _drafter_for(target, tmp_path / "drafter")
    spec = {"method": "dspark", "model": str(drafter), "enable_adaptive_verification": False}
    llm = LLM(
        model=str(target),
        tokenizer=str(hf_dir),
        dtype="float32",
        num_kv_blocks=32,
        max_model_len=64,
        speculative_config=spec,
    )
    assert llm.engine.dspark_model is not None
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
