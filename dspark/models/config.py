"""The shape of a decoder: one dataclass read from a Hugging Face config.json or from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dspark.errors import ModelLoadError

# Hugging Face architecture name -> our family. All three share one module (models/llama.py).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    family: str  # llama | qwen2 | qwen3
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
    tie_word_embeddings: bool
    attention_bias: bool  # qwen2: biases on q/k/v
    qk_norm: bool  # qwen3: RMSNorm on each head of q and k
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str) -> ModelConfig:
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{source}: config.json must hold a JSON object, not {type(cfg).__name__}")
        archs = cfg.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            raise ModelLoadError(f"{source}: unsupported architecture {archs!r}; supported: {', '.join(ARCHITECTURES)}")
        _check_rope(cfg, source)

        def get(key: str, kind: type, default: Any = None) -> Any:
            value = cfg.get(key, default)
            if value is None:
                raise ModelLoadError(f"{source}: config.json lacks the key {key!r}")
            try:
                out = kind(value)
            except (TypeError, ValueError):
                raise ModelLoadError(f"{source}: config.json has {key}={value!r}, expected a {kind.__name__}") from None
            if kind is int and out <= 0:
                raise ModelLoadError(f"{source}: config.json has {key}={value!r}, expected a positive integer")
            return out

        num_heads, hidden = get("num_attention_heads", int), get("hidden_size", int)
        eos = cfg.get("eos_token_id")
        rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)
        try:
            return cls(
                family=family,
                vocab_size=get("vocab_size", int),
                hidden_size=hidden,
                intermediate_size=get("intermediate_size", int),
                num_layers=get("num_hidden_layers", int),
                num_heads=num_heads,
                num_kv_heads=get("num_key_value_heads", int, num_heads),
                head_dim=get("head_dim", int, hidden // num_heads),
                rms_norm_eps=get("rms_norm_eps", float, 1e-6),
                rope_theta=float(rope),
                max_position_embeddings=get("max_position_embeddings", int, 2048),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
                qk_norm=family == "qwen3",
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=eos[0] if isinstance(eos, list) else eos,
            )
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: config.json has an invalid value ({e})") from None


def _check_rope(cfg: dict[str, Any], source: str) -> None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ModelLoadError(f"{source}: rope scaling {kind!r} is not supported yet (only plain RoPE)")
