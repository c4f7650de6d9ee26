"""Fixtures of the server tests: the tiny llama they serve and a random DSpark drafter for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark.speculative.drafters.dspark.checkpoint import random_drafter, save_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def tiny_drafter(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    from dspark.models.loader import load_config

    cfg = DSparkConfig.for_target(load_config(tiny_llama), num_layers=1, block_size=4, num_taps=2, markov_rank=8)
    return save_drafter(random_drafter(cfg, seed=1), tmp_path_factory.mktemp("server-drafter"))
