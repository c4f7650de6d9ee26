"""What the command modules share: the help formatter, loading the LLM, and whether a stream is a terminal."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from dspark.config import EngineConfig
from dspark.llm import LLM


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the line breaks of descriptions and epilogs (the examples), wraps flag help as usual."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36)


def load_llm(config: EngineConfig) -> LLM:
    return LLM(**dataclasses.asdict(config))


def tty(stream: Any) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()
