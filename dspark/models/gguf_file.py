"""Read a GGUF file into (ModelConfig, Hugging Face-named fp32 tensors), dequantizing with the `gguf` package."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.errors import ModelLoadError
from dspark.models.config import ModelConfig

FAMILIES = ("llama", "qwen2", "qwen3")

# GGUF tensor name -> Hugging Face name; {i} is the layer.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def open_gguf(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on damaged files
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader: Any, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in FAMILIES:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r}; supported: {', '.join(FAMILIES)}")
    names = {t.name for t in reader.tensors}

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    tokens = _field(reader, "tokenizer.ggml.tokens")
    if _field(reader, f"{arch}.vocab_size") is None and not tokens:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.vocab_size and tokenizer.ggml.tokens")
    try:
        hidden, num_heads = int(need("embedding_length")), int(need("attention.head_count"))
        return ModelConfig(
            family=arch,
            vocab_size=int(_field(reader, f"{arch}.vocab_size") or len(tokens or [])),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv") or num_heads),
            head_dim=int(_field(reader, f"{arch}.attention.key_length") or hidden // num_heads),
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base") or 1e4),
            max_position_embeddings=int(need("context_length")),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        )
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelLoadError(f"{path}: GGUF metadata has an invalid value ({e})") from None


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleaving (it converts rotate-half RoPE rows to GGML's pairwise layout)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(reader: Any, cfg: ModelConfig, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, fp32 tensor) for every tensor, dequantized and un-permuted."""
    import gguf

    for t in reader.tensors:
        m = _LAYER_RE.fullmatch(t.name)
        if m and m.group(2) in _LAYER_NAMES:
            name = f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
        elif t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        else:
            continue  # e.g. rope_freqs: derived, not loaded
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            data = np.asarray(data, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        except Exception as e:
            raise ModelLoadError(f"{path}: tensor {t.name} cannot be read ({type(e).__name__}: {e})") from None
        if cfg.family == "llama" and m and m.group(2) in ("attn_q", "attn_k"):
            heads = cfg.num_heads if m.group(2) == "attn_q" else cfg.num_kv_heads
            expected = (heads * cfg.head_dim, *((cfg.hidden_size,) if m.group(3) == "weight" else ()))
            if data.shape != expected:
                raise ModelLoadError(f"{path}: tensor {t.name} has shape {data.shape}, the config implies {expected}")
            data = _unpermute(data, heads)
        yield name, torch.from_numpy(np.array(data, dtype=np.float32, copy=True))
