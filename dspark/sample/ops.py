"""From logits to the distribution a token is drawn from: the one place it is computed.

Plain sampling (sampler.py), speculative verification (rejection.py) and the DSpark drafter all shape their rows here,
so a token verified speculatively is judged against exactly the distribution plain sampling draws it from.

Order (as vLLM): stop tokens banned while min_tokens is not reached -> penalties -> temperature -> min_p -> top_k ->
top_p. Greedy rows (temperature < GREEDY_BELOW) are one-hot at the argmax of the processed logits, whatever their
filters. Rows with a temperature alone are temperature_probs(); logits_to_probs() is the general case and goes
through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.config import GREEDY_BELOW
from dspark.utils.transfer import upload


@dataclass
class SamplingRow:
    """One request's sampling inputs at one output position (host values; built by the model runner)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    counter: int  # index of the output token being sampled
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    banned_token_ids: tuple[int, ...] = ()  # stop tokens masked while min_tokens is not reached
    num_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def softmax_temperatures(temperatures: Sequence[float]) -> list[float]:
    """The temperature each row's softmax divides by: its own; a greedy row's, whose softmax is never read (it is
    one-hot at the argmax, or read only there), GREEDY_BELOW rather than 0."""
    return [max(t, GREEDY_BELOW) for t in temperatures]


def temperature_probs(
    logits: torch.Tensor,  # [n, vocab] fp32, processed (bans, penalties) where a row has any
    temperatures: torch.Tensor,  # [n] fp32 on logits' device, softmax_temperatures()
    greedy: torch.Tensor | None = None,  # [n] bool: rows made one-hot at their argmax; None: none
    top: torch.Tensor | None = None,  # [n] int64: logits.argmax(-1), where the caller has it already
    out: torch.Tensor | None = None,  # [n, vocab] fp32, contiguous: written in place of a new tensor
) -> torch.Tensor:
    """[n, vocab] fp32: softmax(logits / temperature) per row, greedy rows one-hot at their argmax.

    No host value is read (a CUDA graph can capture it), and each row's values do not depend on the other rows."""
    probs = torch.softmax(logits / temperatures[:, None], dim=-1, out=out)
    if greedy is not None:
        # NOTE: masked_fill_ and a one-column scatter, not probs[greedy] = one_hot(...): boolean indexing waits for the
        # device to count the mask, and a one_hot table is [n, vocab] int64, twice the softmax's bytes.
        at_top = (logits.argmax(dim=-1) if top is None else top)[:, None]
        probs.masked_fill_(greedy[:, None], 0.0)
        probs.scatter_(1, at_top, torch.where(greedy[:, None], 1.0, probs.gather(1, at_top)))
    return probs


def logits_to_probs(
    logits: torch.Tensor,  # [>= len(rows), vocab] fp32 raw logits; rows past len(rows) (padding) are ignored
    rows: list[SamplingRow],
) -> torch.Tensor:
    """[len(rows), vocab] fp32: the distribution each row samples from (the module's order), normalised."""
    n = len(rows)
    x = logits[:n].clone()
    # Rows without banned tokens or penalties are not indexed at all: each x[i] is host time per row and step.
    for i in [i for i, r in enumerate(rows) if r.banned_token_ids or r.penalised]:
        r = rows[i]
        if r.banned_token_ids:
            x[i, list(r.banned_token_ids)] = float("-inf")
        apply_penalties(x[i], r)
    temps = upload(softmax_temperatures([r.temperature for r in rows]), torch.float32, x.device)
    greedy = [r.greedy for r in rows]
    probs = temperature_probs(x, temps, upload(greedy, torch.bool, x.device) if any(greedy) else None)
    vocab = x.shape[1]
    for i, r in enumerate(rows):
        if r.greedy or not (r.min_p > 0.0 or 0 < r.top_k < vocab or r.top_p < 1.0):
            continue  # softmax and one-hot rows are normalised already
        p = probs[i]
        if r.min_p > 0.0:
            p.masked_fill_(p < r.min_p * p.max(), 0.0)
        if 0 < r.top_k < vocab or r.top_p < 1.0:
            sorted_p, order = torch.sort(p, descending=True, stable=True)
            keep = torch.ones_like(sorted_p, dtype=torch.bool)
            if 0 < r.top_k < vocab:
                keep[r.top_k :] = False
            if r.top_p < 1.0:
                kept = sorted_p.masked_fill(~keep, 0.0)
                mass_before = torch.cumsum(kept, 0) - kept
                # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
                keep &= mass_before < r.top_p * kept.sum()
            # NOTE: a scatter, not p[order[~keep]] = 0: boolean indexing waits for the device to count the mask.
            p.scatter_(0, order, sorted_p.masked_fill(~keep, 0.0))
        probs[i] = p / p.sum()
    return probs


def apply_penalties(
    row: torch.Tensor,  # [vocab] one row's logits, changed in place
    r: SamplingRow,
) -> None:
    """vLLM's semantics: repetition over prompt and output tokens; presence and frequency over output tokens."""
    if r.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)), dtype=torch.long)
        if len(seen):
            seen = seen.to(row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / r.repetition_penalty, vals * r.repetition_penalty)
    if (r.presence_penalty or r.frequency_penalty) and r.output_token_ids:
        ids = torch.tensor(r.output_token_ids, dtype=torch.long, device=row.device)
        counts = torch.bincount(ids, minlength=row.shape[0]).to(row.dtype)
        row -= r.frequency_penalty * counts + r.presence_penalty * (counts > 0).to(row.dtype)
