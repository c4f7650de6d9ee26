"""What this machine offers: the device and dtype an engine runs on, whether Triton kernels can run, and where dspark
caches what it makes (models, converted weights, built kernels)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from dspark.errors import ConfigError


def cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE") or Path.home() / ".cache" / "dspark")


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", name, "CUDA is not available here; use 'cpu' or 'auto'")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    # NOTE: "auto" is bf16 on GPUs and on CPUs with native bf16 (AVX512-BF16 / AMX), fp32 on other CPUs, where bf16
    # matmuls are emulated and slower than fp32.
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or _cpu_has_bf16() else torch.float32
    return _DTYPES[name]


def _cpu_has_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a private helper: absent on some builds
        return False
