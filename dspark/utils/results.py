"""Result files of the commands (--output-json, --output-plot, --output-md, ...): each path checked before a long run
rather than after it, and a file that cannot be written one ConfigError naming its flag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dspark.errors import ConfigError


def output_path(value: str | None, field: str = "output_json") -> Path | None:
    """An output file flag (--output-json, --output-plot, ...), checked before a long run rather than after it."""
    output = Path(value) if value else None
    if output is not None and not output.parent.is_dir():
        raise ConfigError(field, str(output), f"its directory {output.parent} does not exist")
    return output


def write_text(output: Path | None, text: str, field: str) -> None:
    if output is not None:
        try:
            output.write_text(text)
        except OSError as e:
            raise ConfigError(field, str(output), f"cannot be written ({e})") from None


def write_json(output: Path | None, result: dict[str, Any]) -> None:
    write_text(output, json.dumps(result, indent=2) + "\n", "output_json")
