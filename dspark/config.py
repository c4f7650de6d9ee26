"""User-facing settings: one dataclass per concern, validated in __post_init__.

Errors name the field, the value and what is allowed (ConfigError), so a typo in a request or on the command line
never surfaces as a traceback from deep inside the engine.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from dspark.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "sdpa", "torch", "triton")
BATCH_INVARIANT_ENV = "DSPARK_BATCH_INVARIANT"  # "1": batch-invariant mode by default (as vLLM's VLLM_BATCH_INVARIANT)
OUTPUT_KINDS = ("cumulative", "delta", "final_only")
MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # temperatures under this mean argmax (engine-wide)
MAX_SPECULATIVE_TOKENS = 32


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, value, "must be an integer")
    if value < low or (high is not None and value > high):
        raise ConfigError(name, value, f"must be in [{low}, {high if high is not None else 'inf'}]")


def _check_bool(name: str, value: object) -> None:
    # No truthiness: "false" or 0 from a config file would otherwise quietly mean the opposite of, or other than,
    # what was meant.
    if not isinstance(value, bool):
        raise ConfigError(name, value, "true or false")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(name, value, f"one of {', '.join(choices)}")


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
    # vLLM's: the logprob of every prompt token given the ones before it (the first has none), its rank and the top N.
    # Such a request takes no prefix-cache hits: every prompt position is computed.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    max_speculative_tokens: int | None = None  # cap on this request's drafts per step; 0 opts out; None: the engine's
    # vLLM's RequestOutputKind: "cumulative" (an output every step it produced tokens, with all text, token ids and
    # logprobs so far), "delta" (the same outputs with only what each adds: what a stream sends, without copying a
    # request's whole output every step) or "final_only" (one output, when it finishes: what offline generate() needs,
    # and the host builds no per-step outputs, which at high load cost more than the GPU step)
    output_kind: str = "cumulative"

    def clone(self) -> SamplingParams:
        """An independent copy, without re-checking (deepcopy's generic walk costs ~50 us a request in the server)."""
        params = copy.copy(self)
        params.stop, params.stop_token_ids = list(self.stop or []), list(self.stop_token_ids or [])
        return params

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
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.max_speculative_tokens is not None:
            _check_int("max_speculative_tokens", self.max_speculative_tokens, 0, MAX_SPECULATIVE_TOKENS)
        _check_choice("output_kind", self.output_kind, OUTPUT_KINDS)
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
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
    def has_penalties(self) -> bool:
        """Presence, frequency or repetition penalties: sampling reads the request's tokens."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def stop_text_margin(self) -> int:
        """Characters held back from a stream so that a stop string split across tokens is never shown."""
        return max((len(s) for s in self.stop), default=1) - 1


SPEC_METHODS = ("dspark", "ngram")
DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")
ADAPTIVE_MODES = ("async", "sync")


@dataclass
class SpeculativeConfig:
    """Speculative decoding, with vLLM's keys (`--speculative-config '{"method": "ngram", ...}'`).

    method: "dspark" (a trained DSpark drafter: `model` is its directory) or "ngram" (prompt lookup, nothing to train).
    num_speculative_tokens: drafts verified per request and step (fixed k), at most the drafter's block size.
    draft_sample_method: "probabilistic" drafts by sampling the drafter's distribution and verifies by rejection
    sampling; "greedy" drafts its argmax and verifies strictly (the same tokens as without speculation for a seed).
    prompt_lookup_min / prompt_lookup_max: n-gram lengths the "ngram" method matches.
    enable_adaptive_verification: confidence-scheduled verification (docs/scheduling.md): each step verifies the
    drafts that buy the most tokens per millisecond, up to num_speculative_tokens per request; false: every draft.
    adaptive_verification_mode: "async" (the budget from survivals one or two steps old, the drafts from live ones:
    the step never waits) or "sync" (the paper's Algorithm 1 on live survivals, with its early stop). Both lossless.
    adaptive_verification_ema_alpha: per-request, per-position smoothing of confidences (0 disables it).
    trace_path: record every step's confidences and outcomes to this JSONL file (for `dspark simulate`).
    """

    method: str
    num_speculative_tokens: int | None = None  # None: the drafter's block size (dspark) or 4 (ngram)
    model: str | None = None
    draft_sample_method: str = "probabilistic"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    enable_adaptive_verification: bool = True
    adaptive_verification_mode: str = "async"
    adaptive_verification_ema_alpha: float = 0.8
    trace_path: str | None = None

    def __post_init__(self) -> None:
        _check_choice("speculative_config.method", self.method, SPEC_METHODS)
        if self.num_speculative_tokens is not None:
            _check_int(
                "speculative_config.num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS
            )
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError("speculative_config.model", self.model, "a drafter directory (config.json + safetensors)")
        if self.method == "ngram" and self.model is not None:
            raise ConfigError("speculative_config.model", self.model, "the 'ngram' method takes no drafter model")
        _check_choice("speculative_config.draft_sample_method", self.draft_sample_method, DRAFT_SAMPLE_METHODS)
        _check_int("speculative_config.prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        _check_int("speculative_config.prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, 64)
        _check_bool("speculative_config.enable_adaptive_verification", self.enable_adaptive_verification)
        _check_choice("speculative_config.adaptive_verification_mode", self.adaptive_verification_mode, ADAPTIVE_MODES)
        _check_float(
            "speculative_config.adaptive_verification_ema_alpha", self.adaptive_verification_ema_alpha, 0.0, 0.999
        )
        if self.trace_path is not None and (not isinstance(self.trace_path, str) or not self.trace_path):
            raise ConfigError("speculative_config.trace_path", self.trace_path, "a file path for the JSONL trace")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known, key=str)  # by name: a dict made in Python may have keys of any type
        if unknown:
            raise ConfigError(
                f"speculative_config.{unknown[0]}",
                values[unknown[0]],
                f"unknown key; known: {', '.join(sorted(known))}",
            )
        if "method" not in values:
            raise ConfigError("speculative_config.method", None, f"required: one of {', '.join(SPEC_METHODS)}")
        return cls(**values)

    @property
    def verify_method(self) -> str:
        """How drafts are verified: rejection sampling needs the drafter's distribution; n-gram has none."""
        return "probabilistic" if self.method == "dspark" and self.draft_sample_method == "probabilistic" else "strict"


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
    # Overlap: the host prepares and launches decode step t+1 while the device runs step t (vLLM's
    # --async-scheduling). None: on for CUDA, off elsewhere (a CPU runs its steps synchronously anyway).
    async_scheduling: bool | None = None
    # auto: Triton on CUDA (when triton is installed); on CPU torch's fused SDPA, or the batch-invariant torch reference
    attention_backend: str = "auto"
    # A token's target logits never depend on the batch around it (how many requests, how many drafts): greedy output
    # with speculation then equals output without it bit for bit in bf16 too, and without speculation (or greedy, or
    # n-gram's strict verification) a seeded request gives the same tokens in any batch. Sampled DSpark drafts are not
    # batch-invariant (the drafter's kernels are the default ones), so rejection sampling's outputs are equal in
    # distribution only. CUDA: every GEMM through one fixed-tile Triton kernel and attention without key splits; CPU:
    # matmul rows padded (utils/numerics.py) and attention in fixed tiles (attention/torch_ref.py). Slower steps
    # either way. The default comes from $DSPARK_BATCH_INVARIANT ("1": on). vLLM's VLLM_BATCH_INVARIANT, SGLang's
    # --enable-deterministic-inference.
    batch_invariant: bool = field(default_factory=lambda: os.environ.get(BATCH_INVARIANT_ENV) == "1")
    seed: int = 0
    speculative_config: dict[str, Any] | SpeculativeConfig | None = None  # a dict is parsed into SpeculativeConfig

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model", self.model, "a model alias, a Hugging Face directory or a .gguf file")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ConfigError("tokenizer", self.tokenizer, "a Hugging Face directory or name (or none: the model's)")
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("device", self.device, DEVICES)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("block_size", self.block_size, 1, 1024)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1)
        _check_float("kv_cache_memory_gb", self.kv_cache_memory_gb, 0.0, 1e4, low_open=True)
        _check_float("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        _check_bool("enforce_eager", self.enforce_eager)
        _check_bool("batch_invariant", self.batch_invariant)
        if self.async_scheduling is not None:
            _check_bool("async_scheduling", self.async_scheduling)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_int("seed", self.seed, 0, 2**63 - 1)
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            if not isinstance(self.speculative_config, dict):
                raise ConfigError("speculative_config", self.speculative_config, "a JSON object / dict of settings")
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def spec(self) -> SpeculativeConfig | None:
        return self.speculative_config  # type: ignore[return-value]
