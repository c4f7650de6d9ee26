"""Per-step traces of speculative decoding, for `dspark simulate` (spec/../bench/simulate.py reads them).

JSONL: a header line (K, drafter, model, device, mode), then one line per step that verified drafts, listing for
each such request the calibrated confidences of the drafts it held (before smoothing), how many it held, verified
and had accepted. Record with fixed k (enable_adaptive_verification false) for the simulator: a block verified in
full tells what every shorter verification would have accepted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
