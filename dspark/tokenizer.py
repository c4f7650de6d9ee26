"""Tokenizer and chat template from a Hugging Face directory or a GGUF file (through transformers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark.errors import ModelLoadError


def load_tokenizer(path: Path) -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        if path.is_dir():
            return transformers.AutoTokenizer.from_pretrained(str(path))
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many types for a missing or damaged tokenizer
        raise ModelLoadError(f"{path}: cannot load a tokenizer ({type(e).__name__}: {e})") from None
