"""Shared fixtures: tiny random Hugging Face models (with SmolLM2's tokenizer) and the real default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import FAMILIES, make_hf_model

# Most tests compare bits (speculation against none, a request alone against in a batch, chunked against whole,
# async steps against synchronous ones): engines run in batch-invariant mode unless a test asks for the default one
# (EngineConfig.batch_invariant=False: the fast CPU path, tested on its own).
os.environ.setdefault("DSPARK_BATCH_INVARIANT", "1")


@pytest.fixture(scope="session", autouse=True)
def _cost_model_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Step-cost profiles of the session's throwaway models go to a temporary directory, not the user's cache."""
    import os

    os.environ["DSPARK_COST_MODELS"] = str(tmp_path_factory.mktemp("cost-models"))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from dspark.models.registry import resolve_model

    return resolve_model("smollm2-135m-instruct")  # downloads into $DSPARK_CACHE on a fresh machine


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    from dspark.models.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(smollm2_path).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    """family -> a saved tiny model directory (config.json, model.safetensors, tokenizer files)."""
    import shutil

    dirs = {}
    for family in FAMILIES:
        out = tmp_path_factory.mktemp(f"tiny-{family}")
        make_hf_model(family).save_pretrained(out, safe_serialization=True)
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, out / f.name)
        dirs[family] = out
    return dirs
