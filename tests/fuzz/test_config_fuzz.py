"""Property-based fuzz of the settings a user types, with bad input: SamplingParams(**kwargs), EngineConfig's
fields, and the speculative config, as a dict and as the JSON text of `--speculative-config`. Each field gets either a
plausible value or anything at all (wrong types, NaN and infinities, ints too long to print, bytes, containers,
objects). Properties: every input constructs a config whose fields have the types they promise, or raises ConfigError
(never TypeError, ValueError, OverflowError, RecursionError, ...) whose message names the field, shows the value and
says what is allowed."""

from __future__ import annotations

import argparse
import json
import math
from fractions import Fraction
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark.config import EngineConfig, SamplingParams, SpeculativeConfig
from dspark.engine.args import engine_config
from dspark.errors import ConfigError

# Derandomized (the same examples on every run, as CI needs) and no example database (nothing written to the tree).
FUZZ = settings(
    derandomize=True, database=None, deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow]
)

HUGE = 10**5000  # past Python's 4300-digit limit on int -> str: repr() of it raises ValueError
# Mapped, not listed in sampled_from: hypothesis prints the lists it samples from, and cannot print HUGE.
HUGE_INTS = st.sampled_from([1, -1]).map(lambda sign: sign * HUGE)
SPECIAL = st.sampled_from(
    [
        10**400,
        2**63,
        2**64,
        -(2**63) - 1,
        -1,
        0,
        1,
        True,
        False,
        None,
        0.5,
        -0.0,
        1e308,
        5e-324,
        math.nan,
        math.inf,
        -math.inf,
        "",
        "\ud800",
        "1",
        "true",
        "x" * 100_000,
        b"ngram",
        Fraction(1, 3),
        1j,
        object(),
        [],
        {},
        (),
        frozenset(),
        [[]],
        [None],
        [""],
        [-1],
    ]
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | SPECIAL
    | HUGE_INTS
    | HUGE_INTS.map(lambda i: [i])
)
ANYTHING = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=6) | st.integers(), inner, max_size=3)
    ),
    max_leaves=8,
)


def fields(plausible: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Any subset of the fields, each a plausible value or (as often) anything at all."""
    return st.fixed_dictionaries({}, optional={k: v | ANYTHING for k, v in plausible.items()})


SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-2, 100),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**64), 2**64),
    "max_tokens": st.none() | st.integers(0, 64),
    "min_tokens": st.integers(-1, 64),
    "stop": st.none() | st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3),
    "stop_token_ids": st.none() | st.lists(st.integers(-1, 100), max_size=3),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(0, 3),
    "logprobs": st.none() | st.integers(-1, 21),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "max_speculative_tokens": st.none() | st.integers(-1, 33),
    "output_kind": st.sampled_from(["cumulative", "final_only", "all"]),
}
SPEC: dict[str, st.SearchStrategy[Any]] = {
    "method": st.sampled_from(["ngram", "dspark", "eagle"]),
    "num_speculative_tokens": st.none() | st.integers(0, 33),
    "model": st.none() | st.sampled_from(["", "drafters/d1"]),
    "draft_sample_method": st.sampled_from(["probabilistic", "greedy", "top_k"]),
    "prompt_lookup_min": st.integers(0, 65),
    "prompt_lookup_max": st.integers(0, 65),
    "enable_adaptive_verification": st.booleans(),
    "adaptive_verification_mode": st.sampled_from(["async", "sync", "lazy"]),
    "adaptive_verification_ema_alpha": st.floats(0, 1),
    "trace_path": st.none() | st.sampled_from(["", "trace.jsonl"]),
}
UNKNOWN_KEYS = st.sampled_from(["k", "Method", "", "num_speculative_tokens ", "speculative_model"]) | st.integers()


@st.composite
def spec_dicts(draw: st.DrawFn) -> dict[Any, Any]:
    d: dict[Any, Any] = draw(fields(SPEC))
    for key in draw(st.lists(UNKNOWN_KEYS, max_size=2)):
        d[key] = draw(ANYTHING)
    return d


ENGINE: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["tiny", ""]),
    "tokenizer": st.none() | st.just("tok"),
    "dtype": st.sampled_from(["auto", "float32", "int8"]),
    "device": st.sampled_from(["auto", "cpu", "tpu"]),
    "max_model_len": st.none() | st.integers(0, 4096),
    "max_num_seqs": st.integers(0, 512),
    "max_num_batched_tokens": st.integers(0, 4096),
    "block_size": st.integers(0, 2048),
    "enable_prefix_caching": st.booleans(),
    "num_kv_blocks": st.none() | st.integers(0, 4096),
    "kv_cache_memory_gb": st.floats(0, 20),
    "gpu_memory_utilization": st.floats(0, 1.1),
    "enforce_eager": st.booleans(),
    "attention_backend": st.sampled_from(["auto", "torch", "flash"]),
    "seed": st.integers(-1, 2**64),
    "speculative_config": st.none() | spec_dicts(),
}


def _check_rejection(e: ConfigError, given: dict[Any, Any]) -> None:
    """The error names a field that was given (or the one required key), shows the value given for it (or the item of
    it at fault), and says what is allowed."""
    assert isinstance(e.field, str), e.field
    top, dot, sub = e.field.partition(".")
    assert top in given, (e.field, list(given))
    value = given[top]
    if dot:  # a key of the speculative config
        assert isinstance(value, dict), (e.field, value)
        if sub == "method" and "method" not in value:  # the one required key: its absence shows as None
            value = None
        else:
            value = value[next(k for k in value if str(k) == sub)]
    items = [value, *(value if isinstance(value, (list, tuple)) else ())]
    assert any(e.value is v for v in items), (e.field, e.value, value)
    message = str(e)
    assert message.startswith(f"{e.field}=") and " is invalid: " in message, message
    assert e.allowed and isinstance(e.allowed, str) and message.endswith(e.allowed), message
    assert len(message) < 2000, f"a message of {len(message)} characters"  # a 100k-character value is shown cut


def _attempt(make: Any, given: dict[Any, Any]) -> Any:
    try:
        return make()
    except ConfigError as e:
        _check_rejection(e, given)
        return None


@FUZZ
@given(fields(SAMPLING))
def test_sampling_params_fuzz(kwargs: dict[str, Any]) -> None:
    p = _attempt(lambda: SamplingParams(**kwargs), kwargs)
    if p is None:
        return
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(p, name)
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), (name, value)
    for name in ("top_k", "min_tokens"):
        assert type(getattr(p, name)) is int, name
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        assert isinstance(getattr(p, name), bool), (name, getattr(p, name))
    assert isinstance(p.stop, list) and all(isinstance(s, str) and s for s in p.stop), p.stop
    assert isinstance(p.stop_token_ids, list) and all(type(t) is int and t >= 0 for t in p.stop_token_ids)
    assert p.max_tokens is None or p.min_tokens <= p.max_tokens
    assert p.stop_text_margin >= 0 and isinstance(p.greedy, bool)


@FUZZ
@given(spec_dicts())
def test_speculative_config_fuzz(values: dict[Any, Any]) -> None:
    config = _attempt(lambda: EngineConfig(speculative_config=values), {"speculative_config": values})
    if config is None:
        return
    spec = config.spec
    assert isinstance(spec, SpeculativeConfig) and spec.verify_method in ("probabilistic", "strict")
    assert isinstance(spec.enable_adaptive_verification, bool)
    assert 1 <= spec.prompt_lookup_min <= spec.prompt_lookup_max


def _as_json(values: dict[Any, Any]) -> str:
    try:  # objects JSON has no spelling for are written as their type's name
        return json.dumps(values, default=lambda v: type(v).__name__)
    except ValueError:  # an int too long to print
        return '{"method": "ngram", "num_speculative_tokens": ' + "9" * 5000 + "}"


def _as_python(values: dict[Any, Any]) -> str:
    try:
        return repr(values)
    except ValueError:
        return "{'method': 'ngram', 'enable_adaptive_verification': True}"


JSON_TEXT = st.one_of(
    st.text(max_size=40),
    spec_dicts().map(_as_json),
    spec_dicts().map(_as_python),  # not JSON: single quotes, True, None
    st.integers(1, 5000).map(lambda d: "[" * d + "]" * d),
    st.integers(1, 5000).map(lambda d: '{"method": "ngram", "k": ' + "[" * d + "]" * d + "}"),
    st.integers(4290, 4400).map(lambda d: '{"method": "ngram", "num_speculative_tokens": ' + "9" * d + "}"),
    st.sampled_from(["", "null", "[]", '"ngram"', '{"method": NaN}', '{"method": "ngram"', '{"\\ud800": 1}']),
)


@FUZZ
@given(JSON_TEXT)
def test_speculative_config_flag_fuzz(text: str) -> None:
    """`--speculative-config TEXT`: bad JSON, deep JSON and huge numbers are ConfigErrors naming the flag's key."""
    try:
        engine_config(argparse.Namespace(speculative_config=text))
    except ConfigError as e:
        assert e.field == "speculative_config" or e.field.startswith("speculative_config."), e.field
        if e.field == "speculative_config":  # the text itself is at fault: shown as given, or as parsed
            assert e.value == text or not isinstance(e.value, dict), e.value
        message = str(e)
        assert message.startswith(f"{e.field}=") and message.endswith(f" is invalid: {e.allowed}"), message
        assert len(message) < 2000, f"a message of {len(message)} characters"


@FUZZ
@given(fields(ENGINE))
def test_engine_config_fuzz(kwargs: dict[str, Any]) -> None:
    config = _attempt(lambda: EngineConfig(**kwargs), kwargs)
    if config is None:
        return
    assert isinstance(config.enable_prefix_caching, bool) and isinstance(config.enforce_eager, bool)
    assert config.tokenizer is None or (isinstance(config.tokenizer, str) and config.tokenizer)
    assert config.spec is None or isinstance(config.spec, SpeculativeConfig)


def test_huge_values_are_shown_cut() -> None:
    """A value whose repr is huge, or cannot even be made (an int past Python's int -> str limit), still gives a
    readable ConfigError rather than a ValueError from inside the error's own message."""
    for value in (HUGE, "x" * 100_000, [HUGE]):
        try:
            SamplingParams(top_p=value)
        except ConfigError as e:
            assert str(e).startswith("top_p=") and len(str(e)) < 1000, str(e)[:300]
        else:
            raise AssertionError(f"a top_p of type {type(value).__name__} was accepted")
