"""SamplingParams and EngineConfig validation: every bad value is a ConfigError naming the field and the value."""

from __future__ import annotations

import math
from typing import Any

import pytest

from dspark.config import EngineConfig, SamplingParams
from dspark.errors import ConfigError, DSparkError

NAN = float("nan")
INF = float("inf")

BAD_SAMPLING: list[tuple[dict[str, Any], str, object]] = [
    ({"temperature": -0.1}, "temperature", -0.1),
    ({"temperature": NAN}, "temperature", NAN),
    ({"temperature": INF}, "temperature", INF),
    ({"temperature": "1.0"}, "temperature", "1.0"),
    ({"top_p": 0.0}, "top_p", 0.0),
    ({"top_p": 1.5}, "top_p", 1.5),
    ({"top_p": NAN}, "top_p", NAN),
    ({"top_k": -2}, "top_k", -2),
    ({"top_k": 2.0}, "top_k", 2.0),
    ({"top_k": True}, "top_k", True),
    ({"min_p": 2.0}, "min_p", 2.0),
    ({"min_p": -0.1}, "min_p", -0.1),
    ({"max_tokens": 0}, "max_tokens", 0),
    ({"max_tokens": -5}, "max_tokens", -5),
    ({"max_tokens": 3.0}, "max_tokens", 3.0),
    ({"max_tokens": True}, "max_tokens", True),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", 5),
    ({"min_tokens": -1}, "min_tokens", -1),
    ({"presence_penalty": 2.5}, "presence_penalty", 2.5),
    ({"presence_penalty": -2.01}, "presence_penalty", -2.01),
    ({"frequency_penalty": -3.0}, "frequency_penalty", -3.0),
    ({"frequency_penalty": NAN}, "frequency_penalty", NAN),
    ({"repetition_penalty": 0.0}, "repetition_penalty", 0.0),
    ({"repetition_penalty": -1.0}, "repetition_penalty", -1.0),
    ({"repetition_penalty": INF}, "repetition_penalty", INF),
    ({"logprobs": 21}, "logprobs", 21),
    ({"logprobs": -1}, "logprobs", -1),
    ({"logprobs": False}, "logprobs", False),
    ({"seed": 2**63}, "seed", 2**63),
    ({"seed": 1.5}, "seed", 1.5),
    ({"seed": True}, "seed", True),
    ({"stop": [""]}, "stop", ""),
    ({"stop": ""}, "stop", ""),
    ({"stop": ["ok", 3]}, "stop", 3),
    ({"stop_token_ids": [-1]}, "stop_token_ids", -1),
    ({"stop_token_ids": [2, "3"]}, "stop_token_ids", "3"),
    ({"stop_token_ids": [True]}, "stop_token_ids", True),
    ({"max_speculative_tokens": -1}, "max_speculative_tokens", -1),
    ({"max_speculative_tokens": 33}, "max_speculative_tokens", 33),
]

BAD_ENGINE: list[tuple[dict[str, Any], str, object]] = [
    ({"model": ""}, "model", ""),
    ({"dtype": "int8"}, "dtype", "int8"),
    ({"dtype": "fp16"}, "dtype", "fp16"),
    ({"device": "tpu"}, "device", "tpu"),
    ({"block_size": 0}, "block_size", 0),
    ({"block_size": 2048}, "block_size", 2048),
    ({"block_size": True}, "block_size", True),
    ({"max_model_len": 0}, "max_model_len", 0),
    ({"max_num_seqs": 0}, "max_num_seqs", 0),
    ({"max_num_seqs": 1.0}, "max_num_seqs", 1.0),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens", 0),
    ({"num_kv_blocks": 0}, "num_kv_blocks", 0),
    ({"kv_cache_memory_gb": 0.0}, "kv_cache_memory_gb", 0.0),
    ({"kv_cache_memory_gb": NAN}, "kv_cache_memory_gb", NAN),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization", 0.0),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization", 1.5),
    ({"seed": -1}, "seed", -1),
    ({"speculative_config": "ngram"}, "speculative_config", "ngram"),
    ({"speculative_config": {"method": "eagle"}}, "speculative_config.method", "eagle"),
    ({"speculative_config": {"num_speculative_tokens": 3}}, "speculative_config.method", None),
    ({"speculative_config": {"method": "ngram", "k": 3}}, "speculative_config.k", 3),
    (
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}},
        "speculative_config.num_speculative_tokens",
        0,
    ),
    (
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 33}},
        "speculative_config.num_speculative_tokens",
        33,
    ),
    (
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": "7"}},
        "speculative_config.num_speculative_tokens",
        "7",
    ),
    (
        {"speculative_config": {"method": "dspark", "draft_sample_method": "top_k"}},
        "speculative_config.draft_sample_method",
        "top_k",
    ),
    ({"speculative_config": {"method": "ngram", "model": "x"}}, "speculative_config.model", "x"),
    ({"speculative_config": {"method": "ngram", "prompt_lookup_min": 0}}, "speculative_config.prompt_lookup_min", 0),
    (
        {"speculative_config": {"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}},
        "speculative_config.prompt_lookup_max",
        2,
    ),
    (
        {"speculative_config": {"method": "ngram", "enable_adaptive_verification": "yes"}},
        "speculative_config.enable_adaptive_verification",
        "yes",
    ),
    (
        {"speculative_config": {"method": "ngram", "adaptive_verification_mode": "lazy"}},
        "speculative_config.adaptive_verification_mode",
        "lazy",
    ),
    (
        {"speculative_config": {"method": "ngram", "adaptive_verification_ema_alpha": 1.0}},
        "speculative_config.adaptive_verification_ema_alpha",
        1.0,
    ),
    ({"speculative_config": {"method": "ngram", "trace_path": ""}}, "speculative_config.trace_path", ""),
]


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _check_error(err: ConfigError, field: str, value: object) -> None:
    assert err.field == field
    assert _same(err.value, value)
    msg = str(err)
    assert field in msg and repr(value) in msg
    assert err.allowed and err.allowed in msg
    assert isinstance(err, ValueError) and isinstance(err, DSparkError)


@pytest.mark.parametrize(("kwargs", "field", "value"), BAD_SAMPLING, ids=[str(k) for k, _, _ in BAD_SAMPLING])
def test_bad_sampling_params_raise_config_error(kwargs: dict[str, Any], field: str, value: object) -> None:
    with pytest.raises(ConfigError) as exc:
        SamplingParams(**kwargs)
    _check_error(exc.value, field, value)


@pytest.mark.parametrize(("kwargs", "field", "value"), BAD_ENGINE, ids=[str(k) for k, _, _ in BAD_ENGINE])
def test_bad_engine_config_raises_config_error(kwargs: dict[str, Any], field: str, value: object) -> None:
    with pytest.raises(ConfigError) as exc:
        EngineConfig(**kwargs)
    _check_error(exc.value, field, value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"top_p": 1.0, "top_k": -1},
        {"top_k": 0},
        {"top_k": 50, "top_p": 1e-3, "min_p": 1.0},
        {"max_tokens": None, "min_tokens": 100},
        {"max_tokens": 4, "min_tokens": 4},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 1e-3},
        {"logprobs": 0},
        {"logprobs": 20},
        {"seed": -(2**63)},
        {"seed": 2**63 - 1},
        {"stop_token_ids": [0, 49151]},
        {"temperature": 2},  # an int is a fine number
    ],
    ids=str,
)
def test_valid_sampling_params(kwargs: dict[str, Any]) -> None:
    p = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(p, k) == v


def test_sampling_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens) == (1.0, 1.0, -1, 0.0, 16, 0)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.greedy
    assert p.seed is None and p.logprobs is None and p.skip_special_tokens


def test_stop_str_becomes_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == [5, 6]


def test_derived_properties() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert SamplingParams(stop=["a", "abcd", "ab"]).stop_text_margin == 3
    assert SamplingParams(stop="x").stop_text_margin == 0
    assert SamplingParams().stop_text_margin == 0


def test_engine_config_defaults_are_valid() -> None:
    c = EngineConfig()
    assert c.model == "smollm2-135m-instruct"
    assert c.block_size == 16 and c.max_num_seqs == 256 and c.max_num_batched_tokens == 2048
    assert c.dtype == "auto" and c.device == "auto" and c.enable_prefix_caching
    for dtype in ("auto", "float32", "bfloat16", "float16"):
        assert EngineConfig(dtype=dtype).dtype == dtype
    for device in ("auto", "cpu", "cuda"):
        assert EngineConfig(device=device).device == device
    assert EngineConfig(block_size=1024, gpu_memory_utilization=1.0, max_model_len=1).block_size == 1024


@pytest.mark.parametrize(("kwargs", "field"), [({"stop": 5}, "stop"), ({"stop_token_ids": 5}, "stop_token_ids")])
def test_non_list_stop_values_raise_config_error(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        SamplingParams(**kwargs)
    assert exc.value.field == field
