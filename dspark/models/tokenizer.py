"""Tokenizer and chat template from a Hugging Face directory or a GGUF file (through transformers).

Building a fast tokenizer from GGUF metadata takes seconds, so the result is saved once under
$DSPARK_CACHE/tokenizers/, keyed by the file's name, size and a hash of its header (where the vocabulary lives), and
loaded from there afterwards.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dspark.errors import ModelLoadError
from dspark.models.registry import cache_dir

HEADER_BYTES = 16 << 20  # GGUF keeps its metadata (the vocabulary included) before the tensor data
CACHE_VERSION = 2  # bump when the conversion changes, so stale cached tokenizers are not reused


def load_tokenizer(path: Path) -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        if path.is_dir():
            return transformers.AutoTokenizer.from_pretrained(str(path))
        cached = _cache_path(path)
        if (cached / "tokenizer_config.json").is_file():
            return transformers.AutoTokenizer.from_pretrained(str(cached))
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many types for a missing or damaged tokenizer
        raise ModelLoadError(f"{path}: cannot load a tokenizer ({type(e).__name__}: {e})") from None
    _special_tokens_from_metadata(tokenizer, path)
    _save(tokenizer, cached)
    return tokenizer


def _special_tokens_from_metadata(tokenizer: Any, path: Path) -> None:
    """Take BOS/EOS from the GGUF's own metadata: transformers' GGUF conversion guesses them differently across
    versions (5.17 makes SmolLM2's EOS <|im_start|>, 5.24 <|im_end|>; the file says id 2, <|im_end|>)."""
    from dspark.models.gguf_file import open_gguf

    reader = open_gguf(path)
    for attr, key in (("eos_token", "tokenizer.ggml.eos_token_id"), ("bos_token", "tokenizer.ggml.bos_token_id")):
        field = reader.fields.get(key)
        if field is not None:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(field.contents())))


def _cache_path(gguf: Path) -> Path:
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        h.update(f.read(HEADER_BYTES))
    key = f"{gguf.stem}-{gguf.stat().st_size}-{h.hexdigest()[:16]}-v{CACHE_VERSION}"
    return cache_dir() / "tokenizers" / key


def _save(tokenizer: Any, target: Path) -> None:
    """Best effort: a read-only or full cache only costs the next start its few seconds."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(dir=target.parent))
    except OSError:
        return
    try:
        tokenizer.save_pretrained(staged)
        os.replace(staged, target)  # atomic: a concurrent start never sees half a tokenizer
    except OSError:
        shutil.rmtree(staged, ignore_errors=True)
