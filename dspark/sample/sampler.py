"""Plain (non-speculative) sampling of one token per request, reproducible whatever the batch.

A request's sampling path (Request.sampling_path) picks the method: `greedy` (the raw logits' argmax), `temperature`
(temperature_probs and a draw, without a SamplingRow per request) or `tokens` for everything else (logits_to_probs and
a draw); `__call__` is `tokens` with logprobs. The fast paths give the tokens the general one gives the same rows.
Logprobs are of the raw model distribution (before any processing), as vLLM v1 returns by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.kernels import cpu as cpu_kernels
from dspark.sample.ops import SamplingRow, logits_to_probs, temperature_probs
from dspark.sample.random import draw, uniforms
from dspark.utils.transfer import download, upload


@dataclass
class SampledRow:
    token_id: int
    logprob: float | None = None  # of the sampled token (raw distribution)
    rank: int | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,  # [>= len(rows), vocab] fp32; padding rows past len(rows) are ignored
        rows: list[SamplingRow],
    ) -> list[SampledRow]:
        """The rows' tokens on the host, with their logprobs where a row asks for them."""
        tokens = self.tokens(logits, rows)
        if all(r.num_logprobs is None for r in rows):
            return [SampledRow(t) for t in download(tokens)[0]]
        raw_logprobs = torch.log_softmax(logits[: len(rows)], dim=-1)
        host = download(tokens)[0]
        return [self.describe(t, raw_logprobs, i, r) for i, (t, r) in enumerate(zip(host, rows, strict=True))]

    def describe(self, token: int, raw_logprobs: torch.Tensor | None, i: int, row: SamplingRow) -> SampledRow:
        """The sampled token of row i, with its logprob, rank and the top logprobs when the row asks for them."""
        res = SampledRow(token)
        if raw_logprobs is not None and row.num_logprobs is not None:
            lp = raw_logprobs[i]
            res.logprob = lp[token].item()
            res.rank = int((lp > lp[token]).sum().item()) + 1
            if row.num_logprobs:
                top = torch.topk(lp, row.num_logprobs)
                res.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        return res

    def tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The rows' tokens ([len(rows)] int64 on logits' device, not waited for), any sampling parameters."""
        return sample_probs(logits_to_probs(logits, rows), rows)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """tokens() for greedy rows with nothing banned and no penalties ([n, vocab] -> [n] int64, not waited for): the
        raw argmax, which is where their one-hot distribution puts its mass, without building it."""
        if cpu_kernels.supports(logits) and logits.dim() == 2 and logits.stride(1) == 1:
            return cpu_kernels.argmax(logits)  # torch's CPU argmax is a scalar loop: ~4x slower on a 49k vocabulary
        return logits.argmax(dim=-1)

    def temperature(
        self,
        logits: torch.Tensor,  # [>= n, vocab] fp32; padding rows past n are ignored
        temperatures: torch.Tensor,  # [n] fp32 on logits' device, each >= GREEDY_BELOW
        seeds: np.ndarray | Sequence[int],  # [n] int64
        counters: np.ndarray | Sequence[int],  # [n] int64: the output position each row samples
    ) -> torch.Tensor:
        """tokens() for rows with a temperature alone (no top-k/p, min-p, penalties or banned tokens), without a
        SamplingRow per row ([n] int64 on logits' device, not waited for)."""
        n = temperatures.shape[0]
        return draw(temperature_probs(logits[:n], temperatures), uniforms(seeds, counters))


def sample_probs(
    probs: torch.Tensor,  # [>= len(rows), vocab]: logits_to_probs(), greedy rows one-hot
    rows: list[SamplingRow],
) -> torch.Tensor:
    """Each row's token ([len(rows)] int64 on probs' device, not waited for): greedy rows' argmax, the others drawn
    at their counter's uniform."""
    n = len(rows)
    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    if len(sampled) == n:
        return draw(probs[:n], uniforms([r.seed for r in rows], [r.counter for r in rows]))
    tokens = probs[:n].argmax(dim=-1)
    if sampled:
        idx = upload(sampled, torch.int64, probs.device)
        tokens[idx] = draw(probs[idx], uniforms([rows[i].seed for i in sampled], [rows[i].counter for i in sampled]))
    return tokens
