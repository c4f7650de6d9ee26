"""A DSpark drafter's shape: its own config.json, read in DeepSpec's layout and checked against the target.

The file is a Qwen3-style config (hidden_size, heads, intermediate_size, num_hidden_layers, ...) for the draft layers
plus the drafter's own keys, found at the top level or under "dspark_config" (DeepSpec) or "dflash_config" (DFlash):
block_size (K), target_layer_ids, mask_token_id, markov_rank, confidence_head, and the confidence calibration:
sts_temperatures and sts_biases (one fit for every request), or sts_by_temperature (fits at several sampling
temperatures, speculative/calibration.py's StsTable).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dspark.errors import ModelLoadError, shown
from dspark.models.config import ModelConfig
from dspark.speculative.calibration import StsEntry, StsTable

ARCHITECTURE = "DSparkDraftModel"
NESTED_KEYS = ("dspark_config", "dflash_config")
# The drafter's own keys (the rest of config.json describes its Qwen3-style layers); DeepSpec also spells
# confidence_head as enable_confidence_head.
OWN_KEYS = (
    "block_size",
    "target_layer_ids",
    "mask_token_id",
    "markov_rank",
    "confidence_head",
    "sts_temperatures",
    "sts_biases",
    "sts_by_temperature",
    "num_target_layers",
)


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """Evenly spaced from layer 1 to layer L-3 (docs/drafter.md): early, middle and late features."""
    first, last = 1, max(1, num_target_layers - 3)
    if num_taps == 1:
        return (min((first + last) // 2, num_target_layers - 1),)
    ids = sorted({round(first + i * (last - first) / (num_taps - 1)) for i in range(num_taps)})
    return tuple(min(i, num_target_layers - 1) for i in ids)


@dataclass(frozen=True)
class DSparkConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int  # K: a block is [anchor, mask x (K-1)] and yields K drafts
    target_layer_ids: tuple[int, ...]
    markov_rank: int  # 0: no Markov head (DFlash-style: every draft from the backbone alone)
    num_target_layers: int | None  # None: not recorded (DFlash configs); then only the tapped ids are checked
    confidence_head: bool = True
    # None: a learned mask embedding stored with the drafter (`mask_embedding`), for targets such as SmolLM2 whose
    # vocabulary has no spare token; otherwise the target's embedding of this id.
    mask_token_id: int | None = None
    sts_temperatures: tuple[float, ...] | None = None  # per-position calibration (Sequential Temperature Scaling)
    sts_biases: tuple[float, ...] | None = None  # per-position shifts of the scaled logits (train/calibrate.py)
    sts_by_temperature: tuple[StsEntry, ...] | None = None  # fits per sampling temperature (instead of the two above)

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "block_size",
        )
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise ValueError(f"markov_rank={self.markov_rank!r} must be a non-negative integer (0: no Markov head)")
        if self.num_target_layers is not None and (
            not isinstance(self.num_target_layers, int) or self.num_target_layers <= 0
        ):
            raise ValueError(f"num_target_layers={self.num_target_layers!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of {self.num_kv_heads}")
        ids = self.target_layer_ids
        limit = self.num_target_layers
        if not ids or list(ids) != sorted(set(ids)) or ids[0] < 0 or (limit is not None and ids[-1] >= limit):
            raise ValueError(
                f"target_layer_ids={list(ids)} must be strictly increasing layer indices"
                + (f" in [0, {limit})" if limit is not None else "")
            )
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is not in the vocabulary [0, {self.vocab_size})")
        if self.sts_temperatures is not None and len(self.sts_temperatures) != self.block_size:
            raise ValueError(f"sts_temperatures has {len(self.sts_temperatures)} values, block_size={self.block_size}")
        if self.sts_biases is not None and len(self.sts_biases) != self.block_size:
            raise ValueError(f"sts_biases has {len(self.sts_biases)} values, block_size={self.block_size}")
        if self.sts_by_temperature is not None:
            if self.sts_temperatures is not None or self.sts_biases is not None:
                raise ValueError("sts_by_temperature replaces sts_temperatures and sts_biases: give one or the other")
            table = StsTable(self.sts_by_temperature)
            if table.num_positions != self.block_size:
                raise ValueError(
                    f"sts_by_temperature has {table.num_positions} positions, block_size={self.block_size}"
                )

    @property
    def sts_table(self) -> StsTable:
        """The confidence calibration (the identity when none was fitted)."""
        if self.sts_by_temperature is not None:
            return StsTable(self.sts_by_temperature)
        return StsTable.single(self.block_size, self.sts_temperatures, self.sts_biases)

    @property
    def layer_config(self) -> ModelConfig:
        """The draft layers as a Qwen3 decoder (q/k norms, no biases, SwiGLU)."""
        return ModelConfig(
            family="qwen3",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False,
            attention_bias=False,
            qk_norm=True,
        )

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        num_layers: int = 1,
        block_size: int = 7,
        num_taps: int = 3,
        markov_rank: int = 32,
        confidence_head: bool = True,
    ) -> DSparkConfig:
        """A drafter shaped for `target`: its hidden size, heads, MLP width and RoPE; taps spread over its layers."""
        return cls(
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_layers=num_layers,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings,
            block_size=block_size,
            target_layer_ids=default_target_layer_ids(target.num_layers, num_taps),
            markov_rank=markov_rank,
            num_target_layers=target.num_layers,
            confidence_head=confidence_head,
        )

    def check_target(self, target: ModelConfig, source: str) -> None:
        """A clear error when this drafter was made for another target."""
        problems = []
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != the target's {target.vocab_size}")
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != the target's {target.hidden_size}")
        if self.num_target_layers is not None and self.num_target_layers != target.num_layers:
            problems.append(f"num_target_layers {self.num_target_layers} != the target's {target.num_layers} layers")
        if self.target_layer_ids[-1] >= target.num_layers:
            problems.append(f"target_layer_ids {list(self.target_layer_ids)} reach past the target's layers")
        if problems:
            raise ModelLoadError(f"{source}: this drafter was made for another target: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        own = {k: d.pop(k) for k in OWN_KEYS}
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "vocab_size": d["vocab_size"],
            "hidden_size": d["hidden_size"],
            "intermediate_size": d["intermediate_size"],
            "num_hidden_layers": d["num_layers"],
            "num_attention_heads": d["num_heads"],
            "num_key_value_heads": d["num_kv_heads"],
            "head_dim": d["head_dim"],
            "rms_norm_eps": d["rms_norm_eps"],
            "rope_theta": d["rope_theta"],
            "max_position_embeddings": d["max_position_embeddings"],
            "block_size": own.pop("block_size"),
            "num_target_layers": own.pop("num_target_layers"),
            "dspark_config": {**own, "target_layer_ids": list(own["target_layer_ids"])},
        }

    @classmethod
    def from_json(
        cls, raw: Any, source: str, markov_rank: int | None = None, confidence_head: bool = True
    ) -> DSparkConfig:
        """Parse config.json; markov_rank and confidence_head, when the file lacks them, come from the checkpoint.

        Every value is type-checked as JSON (an integer is not a float, a string or a bool), so that a damaged file
        fails here, naming the key, rather than as a wrong shape or an allocation far beyond the tensors' size."""
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{source}: config.json must hold a JSON object")
        own: dict[str, Any] = {}
        for key in NESTED_KEYS:
            if key in raw and not isinstance(raw[key], dict):
                raise ModelLoadError(f"{source}: {key}={shown(raw[key])} is invalid: must be a JSON object")
            own.update(raw.get(key) or {})
        own.update({k: raw[k] for k in (*OWN_KEYS, "enable_confidence_head") if k in raw})
        read = _Reader(source, raw)
        mine = _Reader(source, own)
        num_heads = read.integer("num_attention_heads")
        hidden = read.integer("hidden_size")
        rope = _Reader(source, read.obj("rope_parameters"), "rope_parameters.")
        rope_theta = read.number("rope_theta", None) or rope.number("rope_theta", 1e4)
        confidence = mine.flag("confidence_head", None)
        if confidence is None:  # DeepSpec's spelling
            confidence = mine.flag("enable_confidence_head", confidence_head)
        try:
            return cls(
                vocab_size=read.integer("vocab_size"),
                hidden_size=hidden,
                intermediate_size=read.integer("intermediate_size"),
                num_layers=read.integer("num_hidden_layers"),
                num_heads=num_heads,
                num_kv_heads=read.integer("num_key_value_heads", num_heads),
                head_dim=read.integer("head_dim", hidden // num_heads),
                rms_norm_eps=read.number("rms_norm_eps", 1e-6),
                rope_theta=rope_theta,
                max_position_embeddings=read.integer("max_position_embeddings", 2048),
                block_size=mine.integer("block_size"),
                target_layer_ids=tuple(mine.integers("target_layer_ids")),
                markov_rank=mine.integer("markov_rank", markov_rank or 0, minimum=0),
                num_target_layers=mine.integer("num_target_layers", None),
                confidence_head=confidence,
                mask_token_id=mine.integer("mask_token_id", None, minimum=0),
                sts_temperatures=mine.numbers("sts_temperatures"),
                sts_biases=mine.numbers("sts_biases", positive=False),
                sts_by_temperature=mine.sts_entries("sts_by_temperature"),
            )
        except ValueError as e:  # __post_init__'s checks across fields
            raise ModelLoadError(f"{source}: config.json has an invalid value ({e})") from None

    def save(self, directory: Path) -> None:
        (directory / "config.json").write_text(json.dumps(self.to_json(), indent=2) + "\n")


_REQUIRED = object()


class _Reader:
    """Typed reads of one JSON object's keys; a wrong value raises ModelLoadError naming the key, the value and what
    is allowed. A key that is absent or null takes the default; without one it is required."""

    def __init__(self, source: str, values: dict[str, Any], prefix: str = "") -> None:
        self.source, self.values, self.prefix = source, values, prefix

    def _get(self, key: str, default: Any) -> Any:
        value = self.values.get(key)
        if value is None and default is _REQUIRED:
            raise ModelLoadError(f"{self.source}: config.json lacks the key {self.prefix + key!r}")
        return value

    def _bad(self, key: str, value: Any, allowed: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: {self.prefix + key}={shown(value)} is invalid: {allowed}")

    def integer(self, key: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
        value = self._get(key, default)
        if value is None:
            return default
        if not _is_int(value) or value < minimum:
            raise self._bad(key, value, f"must be an integer >= {minimum}")
        return value

    def number(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if value is None:
            return default
        if not _is_number(value) or value <= 0:
            raise self._bad(key, value, "must be a positive finite number")
        return float(value)

    def flag(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(key, value, "must be true or false")
        return value

    def obj(self, key: str) -> dict[str, Any]:
        value = self.values.get(key)
        if value is not None and not isinstance(value, dict):
            raise self._bad(key, value, "must be a JSON object")
        return value or {}

    def integers(self, key: str) -> list[int]:
        value = self._get(key, _REQUIRED)
        if not isinstance(value, list) or not all(_is_int(i) and i >= 0 for i in value):
            raise self._bad(key, value, "must be a list of layer indices (integers >= 0)")
        return value

    def numbers(self, key: str, positive: bool = True) -> tuple[float, ...] | None:
        value = self._get(key, None)
        if value is None:
            return None
        if not isinstance(value, list) or not all(_is_number(v) and (v > 0 or not positive) for v in value):
            raise self._bad(key, value, f"must be a list of {'positive ' if positive else ''}finite numbers")
        return tuple(float(v) for v in value)

    def sts_entries(self, key: str) -> tuple[StsEntry, ...] | None:
        value = self._get(key, None)
        if value is None:
            return None
        allowed = (
            "must be a non-empty list of {sampling_temperature: a number >= 0, temperatures: [positive numbers],"
            " biases: [numbers]}"
        )
        if not isinstance(value, list) or not value:
            raise self._bad(key, value, allowed)
        entries = []
        for i, item in enumerate(value):
            if not isinstance(item, dict) or set(item) != {"sampling_temperature", "temperatures", "biases"}:
                raise self._bad(f"{key}[{i}]", item, allowed)
            entry = _Reader(self.source, item, f"{self.prefix}{key}[{i}].")
            t = item["sampling_temperature"]
            if not _is_number(t) or t < 0:
                raise entry._bad("sampling_temperature", t, "must be a finite number >= 0")
            temps, biases = entry.numbers("temperatures"), entry.numbers("biases", positive=False)
            if temps is None or biases is None:
                raise self._bad(f"{key}[{i}]", item, allowed)
            entries.append(StsEntry(float(t), temps, biases))
        return tuple(entries)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
