"""The engine's command-line flags (vLLM's names) and the EngineConfig they make, shared by every command that builds
an engine: generate, chat, serve, the offline benchmarks, profile and the drafter commands."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from dspark.config import ATTENTION_BACKENDS, BATCH_INVARIANT_ENV, DEVICES, DTYPES, EngineConfig
from dspark.errors import ConfigError
from dspark.models.registry import DEFAULT_MODEL


def add_engine_args(parser: argparse.ArgumentParser, *, max_num_seqs: bool = True) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        metavar="M",
        default=DEFAULT_MODEL,
        help="model alias, Hugging Face directory or .gguf file (default: %(default)s)",
    )
    g.add_argument("--tokenizer", metavar="T", help="tokenizer directory or .gguf file (default: the model's)")
    g.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weight and activation dtype; auto: bfloat16 on CUDA and on CPUs with native bf16, else float32 "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where to run; auto: CUDA when available (default: %(default)s)",
    )
    g.add_argument(
        "--max-model-len", metavar="N", type=int, help="context length, prompt plus output (default: the model's)"
    )
    if max_num_seqs:
        g.add_argument(
            "--max-num-seqs", metavar="N", type=int, default=256, help="most sequences in flight (default: %(default)s)"
        )
    g.add_argument(
        "--max-num-batched-tokens",
        metavar="N",
        type=int,
        default=2048,
        help="most tokens in one step (default: %(default)s)",
    )
    g.add_argument(
        "--block-size", metavar="N", type=int, default=16, help="tokens per KV-cache block (default: %(default)s)"
    )
    g.add_argument(
        "--kv-cache-memory-gb",
        metavar="GB",
        type=float,
        default=2.0,
        help="KV-cache size on CPU in GiB (default: %(default)s)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        metavar="F",
        type=float,
        default=0.9,
        help="fraction of GPU memory the engine may use, KV cache included (default: %(default)s)",
    )
    g.add_argument("--num-kv-blocks", metavar="N", type=int, help="KV-cache blocks, overriding the two sizes above")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of shared prompt prefixes (default: on)",
    )
    g.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prepare and launch the next decode step while the device runs this one (default: on for CUDA)",
    )
    g.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="auto: Triton on CUDA; on CPU torch's fused SDPA, or the torch reference in batch-invariant mode "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a token's logits never depend on its batch: greedy output with speculation equals output without it "
        "bit for bit (bf16 too); steps get slower (fixed-tile GEMMs, no key splits, the CPU reference kernels) "
        f"(default: off, or {BATCH_INVARIANT_ENV}=1)",
    )
    g.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "dspark", "model": DIR, "num_speculative_tokens": 7, "draft_sample_method": '
        '"probabilistic"|"greedy"}\' (default: none)',
    )
    g.add_argument(
        "--seed",
        metavar="N",
        type=int,
        default=0,
        help="seed of the engine's random streams; the same seed gives the same samples (default: %(default)s)",
    )


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """An EngineConfig from the parsed flags: validated here, before any model is loaded."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and k != "speculative_config"}
    if values.get("batch_invariant") is None:  # unset: the config's default reads the environment
        values.pop("batch_invariant", None)
    raw = getattr(args, "speculative_config", None)
    if raw is not None:
        try:
            values["speculative_config"] = json.loads(raw)
        except ValueError as e:  # not JSON, or an int of more digits than Python converts
            raise ConfigError("speculative_config", raw, f"a JSON object ({e})") from None
        except RecursionError:
            raise ConfigError("speculative_config", raw, "a JSON object, nested less deeply") from None
    return EngineConfig(**{**values, **overrides})
