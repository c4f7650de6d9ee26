"""A GGUF's config and dequantized weights, kept in the cache as JSON and safetensors after the first load.

Parsing the default model's GGUF (its 49k-token vocabulary is read field by field) and dequantizing its weights are
most of an engine's start, and every engine a sweep round or a test builds would pay them again; reading the cached
safetensors takes a fraction of that.

- Keyed by the file's resolved path, size and modification time, and FORMAT (not by its hash: hashing the file costs
  what the cache saves). A changed file gets a new entry.
- Written to a temporary directory and renamed into place, so a concurrent engine never reads half an entry; an entry
  that cannot be read is treated as absent (and written again).
- The tensors are the fp32 ones gguf_tensors yields (Hugging Face names, un-permuted): loading from the cache gives
  the same bits. Files under MIN_BYTES are not cached (they parse fast; the cache would only gather them), and
  DSPARK_WEIGHTS_CACHE=0 turns it off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from dspark.models.config import ModelConfig
from dspark.models.registry import cache_dir

FORMAT = 1
ENV = "DSPARK_WEIGHTS_CACHE"
MIN_BYTES = 8 << 20
Tensors = Iterator[tuple[str, torch.Tensor]]  # (Hugging Face name, fp32 tensor)


def enabled(path: Path) -> bool:
    return os.environ.get(ENV, "1") != "0" and path.stat().st_size >= MIN_BYTES


def entry(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{FORMAT}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
    return cache_dir() / "weights" / f"{path.stem}-{key}"


def cached_config(path: Path) -> ModelConfig | None:
    if not enabled(path):
        return None
    try:
        return ModelConfig(**json.loads((entry(path) / "config.json").read_text()))
    except (OSError, ValueError, TypeError):  # absent, unreadable, or written by another version's fields
        return None


def cached_tensors(path: Path) -> Tensors | None:
    """The entry's tensors, read one at a time; None if it has none that can be opened."""
    if not enabled(path):
        return None
    from safetensors import SafetensorError, safe_open

    file = entry(path) / "model.safetensors"
    try:
        handle = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError, ValueError):
        return None

    def tensors() -> Tensors:
        with handle as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

    return tensors()


def store(path: Path, cfg: ModelConfig, tensors: Tensors) -> Tensors:
    """Write the entry when the cache is on (a failure to write only costs the next load its speed); the tensors,
    to load (materialised when written, else as they came)."""
    if not enabled(path):
        return tensors
    items = list(tensors)
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    final = entry(path)
    tmp = final.parent / f".{final.name}.{os.getpid()}.tmp"
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        save_file(dict(items), str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        if final.exists():  # another engine wrote it meanwhile (or a broken copy): replace it
            shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    except (OSError, SafetensorError):  # a full disk, a read-only cache: the next load parses again
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return iter(items)
