"""Speculative-decoding statistics of a serving benchmark, from the server's /metrics before and after it.

The counters are vLLM's, under the `dspark:` prefix, or `vllm:` so the same client reads a vLLM server:
`spec_decode_num_drafts_total`, `..._num_draft_tokens_total`, `..._num_accepted_tokens_total` and
`..._num_accepted_tokens_per_pos_total{position="i"}`. A counter with several label sets (e.g. one per model or
engine) is summed. The statistics over the run are computed from the deltas, as `vllm bench serve` does:
acceptance rate = accepted / draft tokens in percent, acceptance length = 1 + accepted / drafts, and per position i
the fraction of drafts whose i-th token was accepted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

PREFIXES = ("dspark:", "vllm:")
DRAFTS = "spec_decode_num_drafts_total"
DRAFT_TOKENS = "spec_decode_num_draft_tokens_total"
ACCEPTED = "spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class SpecDecodeCounters:
    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    accepted_per_pos: dict[int, float] = field(default_factory=dict)


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line of a Prometheus text exposition; comments and junk are skipped."""
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        samples.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), value))
    return samples


def spec_decode_counters(text: str | None) -> SpecDecodeCounters | None:
    """The spec-decode counters in a /metrics text; None when it has none (a server without speculation)."""
    if text is None:
        return None
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for name, labels, value in parse_samples(text):
        prefix = next((p for p in PREFIXES if name.startswith(p)), None)
        if prefix is None:
            continue
        short = name[len(prefix) :]
        if short == ACCEPTED_PER_POS and labels.get("position", "").isdigit():
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
        elif short in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
            totals[short] = totals.get(short, 0.0) + value
    if DRAFTS not in totals:
        return None
    return SpecDecodeCounters(totals[DRAFTS], totals.get(DRAFT_TOKENS, 0.0), totals.get(ACCEPTED, 0.0), per_pos)


def spec_decode_stats(before: SpecDecodeCounters | None, after: SpecDecodeCounters | None) -> dict[str, Any]:
    """The result JSON's spec_decode_* fields over the run; empty when the server did not draft during it."""
    if before is None or after is None:
        return {}
    drafts = after.num_drafts - before.num_drafts
    if drafts <= 0:
        return {}
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    positions = range(max(after.accepted_per_pos, default=-1) + 1)
    per_pos = [(after.accepted_per_pos.get(i, 0.0) - before.accepted_per_pos.get(i, 0.0)) / drafts for i in positions]
    return {
        "spec_decode_acceptance_rate": 100.0 * accepted / draft_tokens if draft_tokens > 0 else 0.0,
        "spec_decode_acceptance_length": 1.0 + accepted / drafts,
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_draft_tokens": int(draft_tokens),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_per_position_acceptance_rates": per_pos,
    }
