"""`dspark serve`: the OpenAI-compatible server; its flags and the command are server/cli.py's."""

from __future__ import annotations

from typing import Any

from dspark.cli.common import Formatter
from dspark.server.cli import add_parser as add_serve_parser


def add_parser(subparsers: Any) -> None:
    add_serve_parser(subparsers, Formatter)
