"""JSON-lines files (gzipped when the name ends in .gz): records and prompts, read with errors that name the flag, the
file and the line."""

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


def read_jsonl_prompts(path: Path) -> list[str]:
    """Prompts from a JSON-lines file (gzipped if it ends in .gz): each line's "prompt", else its first "turns" entry,
    else its "question"."""
    wanted = "prompts (a string 'prompt', 'turns' (a list) or 'question' per line)"
    prompts = []
    for lineno, record in numbered_jsonl_records(str(path), "dataset_path", wanted):
        text = _prompt_of(record)
        if not text:
            raise ConfigError("dataset_path", f"{path}:{lineno}", f"needs {wanted}")
        prompts.append(text)
    return prompts


def _prompt_of(record: dict[str, Any]) -> str | None:
    turns = record.get("turns")
    for text in (record.get("prompt"), turns[0] if isinstance(turns, list) and turns else None, record.get("question")):
        if isinstance(text, str) and text:
            return text
    return None
