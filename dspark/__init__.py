"""dspark: an LLM inference engine with DSpark speculative decoding and confidence-scheduled verification."""

from typing import TYPE_CHECKING

from dspark.config import EngineConfig, SamplingParams
from dspark.errors import ConfigError, DSparkError, ModelLoadError
from dspark.outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from dspark.llm import LLM

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # LLM imports torch (1-2 s): loaded on first use, so that `import dspark.<light module>` (the benchmark client, the
    # API server processes) stays light.
    if name == "LLM":
        from dspark.llm import LLM

        return LLM
    raise AttributeError(f"module 'dspark' has no attribute {name!r}")


__all__ = [
    "LLM",
    "CompletionOutput",
    "ConfigError",
    "DSparkError",
    "EngineConfig",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
]
