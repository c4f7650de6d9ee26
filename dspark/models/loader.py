"""Build a model from a Hugging Face directory (config.json + safetensors) or a GGUF file.

Weight loading is data: both sources yield Hugging Face parameter names, which are the module's own names. Only
safetensors, GGUF and JSON are ever parsed (no pickle). A GGUF's config and dequantized weights are cached after the
first load (models/weights_cache.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from dspark.errors import ModelLoadError
from dspark.models import weights_cache
from dspark.models.config import ModelConfig
from dspark.models.gguf_file import gguf_config, gguf_tensors, open_gguf
from dspark.models.llama import CausalLM, Rotary
from dspark.utils.progress import track

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

logger = logging.getLogger("dspark")


def load_config(path: Path) -> ModelConfig:
    if path.is_dir():
        try:
            raw = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
            raise ModelLoadError(f"{path / 'config.json'}: cannot be read ({e})") from None
        return ModelConfig.from_hf(raw, str(path))
    cached = weights_cache.cached_config(path)
    return cached if cached is not None else gguf_config(open_gguf(path), path)


def _safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files (only safetensors and GGUF weights are read)")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from None


def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    if path.is_dir():
        cfg = load_config(path)
        tensors = _safetensors(path)
    else:
        cached_cfg, cached = weights_cache.cached_config(path), weights_cache.cached_tensors(path)
        if cached_cfg is not None and cached is not None:
            cfg, tensors = cached_cfg, cached
        else:
            reader = open_gguf(path)
            cfg = gguf_config(reader, path)
            # Said once, since it takes a while (seconds to minutes) and happens only the first time.
            logger.info("converting %s to fp32 weights (once: later loads read the copy)", path.name)
            converted = track(gguf_tensors(reader, cfg, path), "converting weights", len(reader.tensors), "tensor")
            tensors = weights_cache.store(path, cfg, converted)

    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in tensors:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name not in params:
                raise ModelLoadError(f"{path}: unexpected tensor {name!r} for a {cfg.family} model")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the config implies {tuple(params[name].shape)}"
                )
            params[name].copy_(tensor)
            loaded.add(name)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{path}: missing tensors {shown}")
    # Buffers are derived, not stored: rebuild them on the device after to_empty().
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings).to(device)
    return model.eval()
