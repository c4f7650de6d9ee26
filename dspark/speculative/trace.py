"""Per-step traces of speculative decoding: TraceWriter records them (the engine, when asked for a trace), load_trace
reads them (`dspark simulate`, and the drafter's calibration and evaluation in train/).

JSONL: a header line (K, drafter, model, device, mode), then one line per step that verified drafts, listing for
each such request the calibrated confidences of the drafts it held (before smoothing), how many it held, verified
and had accepted, and its sampling temperature (0: greedy; the calibration it was drafted with depends on it).
Record with fixed k (enable_adaptive_verification false) for the simulator: a block verified in full tells what
every shorter verification would have accepted.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.errors import DSparkError


class TraceWriter:
    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("w")
        self._write({"type": "header", **header})

    def step(self, step: int, num_other_tokens: int, requests: list[dict[str, Any]]) -> None:
        self._write({"type": "step", "step": step, "num_other_tokens": num_other_tokens, "requests": requests})

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TraceError(DSparkError, ValueError):
    """A trace that cannot be read: names the file, the line and the problem."""

    def __init__(self, path: Path, line: int, problem: str) -> None:
        super().__init__(f"{path}:{line}: {problem}" if line else f"{path}: {problem}")


@dataclass
class Block:
    confidences: list[float]  # calibrated, one per draft the simulator may verify
    num_drafts: int  # len(confidences): drafts held, or only the verified ones when the trace recorded no more
    accepted: int  # L: how many leading drafts the target accepts
    temperature: float | None = None  # the request's sampling temperature (0: greedy); None: not recorded


@dataclass
class Trace:
    K: int
    header: dict[str, Any]
    streams: dict[str, list[Block]]  # request id -> its blocks in step order
    num_censored: int = 0  # blocks skipped: partly verified and all of those accepted, so L is unknown

    @property
    def num_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.streams.values())


def load_trace(path: str | Path) -> Trace:
    """Read a JSONL trace: a header line, then one line per engine step (the format is the module docstring's)."""
    path = Path(path)
    try:
        lines = (gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()).splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise TraceError(path, 0, f"cannot be read ({getattr(e, 'strerror', None) or e})") from None
    header: dict[str, Any] | None = None
    streams: dict[str, list[Block]] = {}
    censored = 0
    for lineno, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except ValueError as e:
            raise TraceError(path, lineno, f"not JSON ({e})") from None
        if not isinstance(record, dict):
            raise TraceError(path, lineno, f"expected a JSON object, got {type(record).__name__}")
        kind = record.get("type")
        if header is None:
            if kind != "header":
                raise TraceError(path, lineno, f"the first line must be the header, got type={kind!r}")
            if not _is_int(record.get("K")) or record["K"] < 1:
                raise TraceError(path, lineno, f"header K={record.get('K')!r}: must be a positive integer")
            header = record
            continue
        if kind != "step":
            raise TraceError(path, lineno, f"type={kind!r}: after the header every line must be a step")
        requests = record.get("requests")
        if not isinstance(requests, list):
            raise TraceError(path, lineno, f"requests={requests!r}: must be a list")
        seen: set[str] = set()
        for i, request in enumerate(requests):
            try:
                rid, block = _parse_request(request, header["K"])
            except ValueError as e:
                raise TraceError(path, lineno, f"request {i}: {e}") from None
            if rid in seen:
                raise TraceError(path, lineno, f"request {i}: id {rid!r} appears twice in one step")
            seen.add(rid)
            if block is None:
                censored += 1
            else:
                streams.setdefault(rid, []).append(block)
    if header is None:
        raise TraceError(path, 0, "empty: no header line")
    return Trace(header["K"], header, streams, censored)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_request(request: Any, k: int) -> tuple[str, Block | None]:
    if not isinstance(request, dict):
        raise ValueError(f"expected an object, got {type(request).__name__}")
    rid = request.get("id")
    if not isinstance(rid, str | int) or isinstance(rid, bool):
        raise ValueError(f"id={rid!r}: must be a string")
    conf = request.get("confidences")
    if not isinstance(conf, list) or not all(
        isinstance(c, int | float) and not isinstance(c, bool) and 0.0 <= c <= 1.0 for c in conf
    ):
        raise ValueError(f"confidences={conf!r}: must be a list of numbers in [0, 1]")
    for name in ("num_drafts", "num_verified", "num_accepted"):
        if not _is_int(request.get(name)) or request[name] < 0:
            raise ValueError(f"{name}={request.get(name)!r}: must be a non-negative integer")
    drafts, verified, accepted = request["num_drafts"], request["num_verified"], request["num_accepted"]
    if drafts > k:
        raise ValueError(f"num_drafts={drafts} exceeds K={k}")
    if not accepted <= verified <= drafts:
        raise ValueError(f"needs num_accepted <= num_verified <= num_drafts, got {accepted}, {verified}, {drafts}")
    if not verified <= len(conf) <= drafts:
        raise ValueError(f"{len(conf)} confidences: expected num_verified={verified} to num_drafts={drafts}")
    temperature = request.get("temperature")
    if temperature is not None and not (
        isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature >= 0
    ):
        raise ValueError(f"temperature={temperature!r}: must be a number >= 0")
    if verified < drafts and accepted == verified:
        return str(rid), None  # censored: the first unverified draft might have survived too
    return str(rid), Block(
        [float(c) for c in conf], len(conf), accepted, None if temperature is None else float(temperature)
    )
