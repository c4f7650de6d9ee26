"""dspark: an LLM inference engine with DSpark speculative decoding and confidence-scheduled verification."""

from dspark.config import EngineConfig, SamplingParams
from dspark.errors import ConfigError, DSparkError, ModelLoadError
from dspark.llm import LLM
from dspark.outputs import CompletionOutput, RequestOutput

__version__ = "0.1.0"
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
