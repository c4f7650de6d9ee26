"""JSON-lines evaluation files (gzipped when the name ends in .gz), read with errors that name the file and line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from dspark.errors import ConfigError


def read_jsonl_records(path: str | None, field: str, wanted: str) -> list[dict[str, Any]]:
    """The JSON objects of the file, one per non-empty line. `field` is the flag that named the file and `wanted` what
    it should hold, for the error message."""
    return [record for _, record in numbered_jsonl_records(path, field, wanted)]


def numbered_jsonl_records(path: str | None, field: str, wanted: str) -> list[tuple[int, dict[str, Any]]]:
    """read_jsonl_records with each record's line number, for errors about a record's content."""
    if path is None:
        raise ConfigError(field, None, f"a JSON-lines file of {wanted}")
    file = Path(path)
    try:
        raw = gzip.decompress(file.read_bytes()) if file.suffix == ".gz" else file.read_bytes()
        lines = raw.decode("utf-8").splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ConfigError(field, path, f"a readable JSON-lines file of {wanted} ({e})") from None
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(field, f"{path}:{lineno}", f"each line must be a JSON object ({e})") from None
        if not isinstance(record, dict):
            raise ConfigError(field, f"{path}:{lineno}", "each line must be a JSON object")
        records.append((lineno, record))
    if not records:
        raise ConfigError(field, path, f"holds no records; expected {wanted}")
    return records
