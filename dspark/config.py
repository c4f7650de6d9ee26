"""User-facing settings: one dataclass per concern, validated in __post_init__.

Errors name the field, the value and what is allowed (ConfigError), so a typo in a request or on the command line
never surfaces as a traceback from deep inside the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dspark.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # temperatures under this mean argmax (engine-wide)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, value, "must be an integer")
    if value < low or (high is not None and value > high):
        raise ConfigError(name, value, f"must be in [{low}, {high if high is not None else 'inf'}]")


def _check_float(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> None:
    try:
        finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise ConfigError(name, value, "must be a finite number")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ConfigError(name, value, f"must be in {bracket}{low}, {high}]")


@dataclass
class SamplingParams:
    """How one request samples and when it stops; the names and defaults follow vLLM's SamplingParams."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-N logprobs of each sampled token (the sampled one always included)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check_float("temperature", self.temperature, 0.0, 1e6)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**63 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 1e6, low_open=True)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ConfigError("stop", self.stop, "a string or a list of strings")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ConfigError("stop_token_ids", self.stop_token_ids, "a list of token ids")
        self.stop = list(self.stop or [])
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ConfigError("stop", s, "each stop string must be a non-empty string")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def stop_text_margin(self) -> int:
        """Characters held back from a stream so that a stop string split across tokens is never shown."""
        return max((len(s) for s in self.stop), default=1) - 1


@dataclass
class EngineConfig:
    """What the engine runs and how big it may get. Names follow vLLM's engine arguments."""

    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb (CPU) or gpu_memory_utilization (CUDA)
    kv_cache_memory_gb: float = 2.0
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    seed: int = 0
    speculative_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model", self.model, "a model alias, a Hugging Face directory or a .gguf file")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        if self.device not in DEVICES:
            raise ConfigError("device", self.device, f"one of {', '.join(DEVICES)}")
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("block_size", self.block_size, 1, 1024)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1)
        _check_float("kv_cache_memory_gb", self.kv_cache_memory_gb, 0.0, 1e4, low_open=True)
        _check_float("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        _check_int("seed", self.seed, 0, 2**63 - 1)
        if self.speculative_config is not None:
            raise ConfigError(
                "speculative_config",
                self.speculative_config,
                "speculative decoding is not built yet (issue 3); leave it unset",
            )
