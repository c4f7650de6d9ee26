"""A DSpark drafter's shape: its own config.json, read in DeepSpec's layout and checked against the target.

The file is a Qwen3-style config (hidden_size, heads, intermediate_size, num_hidden_layers, ...) for the draft layers
plus the drafter's own keys, found at the top level or under "dspark_config" (DeepSpec) or "dflash_config" (DFlash):
block_size (K), target_layer_ids, mask_token_id, markov_rank, confidence_head, sts_temperatures, sts_biases.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dspark.errors import ModelLoadError
from dspark.models.config import ModelConfig

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
    "num_target_layers",
)


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """Evenly spaced from layer 1 to layer L-3 (DESIGN.md section 6): early, middle and late features."""
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
        """Parse config.json; markov_rank and confidence_head, when the file lacks them, come from the checkpoint."""
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{source}: config.json must hold a JSON object")
        own: dict[str, Any] = {}
        for key in NESTED_KEYS:
            if isinstance(raw.get(key), dict):
                own.update(raw[key])
        own.update({k: raw[k] for k in (*OWN_KEYS, "enable_confidence_head") if k in raw})

        def need(key: str, where: dict[str, Any] = raw) -> Any:
            if where.get(key) is None:
                raise ModelLoadError(f"{source}: config.json lacks the key {key!r}")
            return where[key]

        try:
            num_heads = int(need("num_attention_heads"))
            hidden = int(need("hidden_size"))
            temps = own.get("sts_temperatures")
            biases = own.get("sts_biases")
            ids = need("target_layer_ids", own)
            return cls(
                vocab_size=int(need("vocab_size")),
                hidden_size=hidden,
                intermediate_size=int(need("intermediate_size")),
                num_layers=int(need("num_hidden_layers")),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta", 1e4)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                block_size=int(need("block_size", own)),
                target_layer_ids=tuple(int(i) for i in ids),
                markov_rank=int(own["markov_rank"] if own.get("markov_rank") is not None else markov_rank or 0),
                num_target_layers=None if own.get("num_target_layers") is None else int(own["num_target_layers"]),
                confidence_head=bool(own.get("confidence_head", own.get("enable_confidence_head", confidence_head))),
                mask_token_id=None if own.get("mask_token_id") is None else int(own["mask_token_id"]),
                sts_temperatures=None if temps is None else tuple(float(t) for t in temps),
                sts_biases=None if biases is None else tuple(float(b) for b in biases),
            )
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: config.json has an invalid value ({e})") from None

    def save(self, directory: Path) -> None:
        (directory / "config.json").write_text(json.dumps(self.to_json(), indent=2) + "\n")
