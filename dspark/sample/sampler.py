"""Logits processing and sampling, one row per request, reproducible whatever the batch.

Order (as vLLM): min_tokens masking of stop tokens -> penalties -> temperature -> min_p -> top_k -> top_p -> sample.
Logprobs are of the raw model distribution (before any processing), as vLLM v1 returns by default.

Randomness is counter-based: the draw for a request's n-th output token is a uniform computed from
(request seed, n) alone, so batch composition, preemption and recompute never change what a request samples.
Sampling inverts the row's CDF (accumulated in fp64) at that uniform, which draws exactly from p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.config import GREEDY_BELOW
from dspark.utils.transfer import download, upload, upload_tensor

_MASK64 = (1 << 64) - 1
_STREAM_SALT = 0x5DEECE66D2F1A7B3


def mix_seed(seed: int, counter: int) -> int:
    """splitmix64 of (seed, counter): independent streams per request and per output position."""
    z = (seed * 0x9E3779B97F4A7C15 + counter * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SamplingRow:
    """One request's sampling inputs for this step (host values; built by the model runner)."""

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


@dataclass
class SampledRow:
    token_id: int
    logprob: float | None = None  # of the sampled token (raw distribution)
    rank: int | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledRow]:
        """logits: [num_rows (>= len(rows), padding allowed), vocab] fp32."""
        n = len(rows)
        raw = logits[:n]
        want_logprobs = any(r.num_logprobs is not None for r in rows)
        if not want_logprobs:
            return [SampledRow(t) for t in download(self.tokens(raw, rows))[0]]
        raw_logprobs = torch.log_softmax(raw, dim=-1)
        probs = self.target_probs(raw, rows)
        tokens = self.sample(probs, rows)
        return [self.describe(tokens[i], raw_logprobs, i, r) for i, r in enumerate(rows)]

    def target_probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution each row samples from: min_tokens masking, penalties, then probabilities()."""
        x = logits[: len(rows)].clone()
        # NOTE: rows without banned tokens or penalties are not indexed at all: x[i] alone costs ~1 us of host time
        # per row and step (a T = 1 step at C = 256 spent 0.3 ms in this loop on the 2-vCPU machine).
        for i in [i for i, r in enumerate(rows) if r.banned_token_ids or _penalised(r)]:
            r = rows[i]
            if r.banned_token_ids:
                x[i, list(r.banned_token_ids)] = float("-inf")
            _apply_penalties(x[i], r)
        return self.probabilities(x, rows)

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

    def probabilities(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution each row samples from: temperature, min_p, top_k, top_p applied. Greedy rows: one-hot."""
        vocab = logits.shape[1]
        temps = upload([max(r.temperature, GREEDY_BELOW) for r in rows], torch.float32, logits.device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        greedy = [i for i, r in enumerate(rows) if r.greedy]
        if greedy:  # one batched write, not a few small kernels per row
            g = upload(greedy, torch.int64, logits.device)
            probs[g] = torch.nn.functional.one_hot(logits[g].argmax(dim=-1), vocab).to(probs.dtype)
        for i, r in enumerate(rows):
            if r.greedy or not (r.min_p > 0.0 or 0 < r.top_k < vocab or r.top_p < 1.0):
                continue  # softmax rows are already normalised
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
                    # NOTE: keep the smallest prefix whose mass reaches top_p (the top token always stays).
                    keep &= mass_before < r.top_p * kept.sum()
                # NOTE: a scatter, not p[order[~keep]] = 0: boolean indexing waits for the device to count the mask.
                p.scatter_(0, order, sorted_p.masked_fill(~keep, 0.0))
            probs[i] = p / p.sum()
        return probs

    def sample(self, probs: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """Inverse-CDF sampling with one counter-based uniform per row (no generator state, no vocab-sized noise).

        Greedy rows are one-hot in probs already (at the argmax of the processed logits)."""
        n = len(rows)
        if probs.device.type == "cpu":
            tops = probs[:n].argmax(dim=-1).tolist() if any(r.greedy for r in rows) else []
            return [
                tops[i] if r.greedy else inverse_cdf(probs[i], uniform(r.seed, r.counter)) for i, r in enumerate(rows)
            ]
        return download(self.sample_on_device(probs, rows))[0]

    def sample_on_device(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """sample()'s tokens as an [n] int64 tensor on probs' device, not waited for (on CPU: computed)."""
        n = len(rows)
        if probs.device.type == "cpu":
            return torch.tensor(self.sample(probs, rows), dtype=torch.int64)
        sampled = [i for i, r in enumerate(rows) if not r.greedy]
        if len(sampled) == n:
            return self.draw(probs[:n], uniforms([r.seed for r in rows], [r.counter for r in rows]))
        tokens = probs[:n].argmax(dim=-1)
        if sampled:
            idx = upload(sampled, torch.int64, probs.device)
            us = uniforms([rows[i].seed for i in sampled], [rows[i].counter for i in sampled])
            tokens[idx] = self.draw(probs[idx], us)
        return tokens

    def tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The rows' sampled tokens ([n] int64 on logits' device, not waited for), without logprobs.

        Plain greedy rows (no banned tokens, no penalties) take the argmax of the raw logits: the token the one-hot
        path of probabilities() picks, without its softmax, one-hot write and clone (on the H200 at C = 16 the
        softmax alone was 21 us a step, plain_step_trace.py)."""
        n = len(rows)
        if all(r.greedy and not r.banned_token_ids and not _penalised(r) for r in rows):
            return logits[:n].argmax(dim=-1)
        return self.sample_on_device(self.target_probs(logits[:n], rows), rows)

    def plain_temperature(
        self,
        logits: torch.Tensor,
        temperatures: Sequence[float] | torch.Tensor,
        seeds: Sequence[int] | np.ndarray,
        counters: Sequence[int] | np.ndarray,
    ) -> torch.Tensor:
        """tokens() for rows that only have a temperature (>= GREEDY_BELOW; no top-k/p, min-p, penalties or banned
        tokens): the same softmax and draws as probabilities() and sample_on_device() make for such rows, without a
        SamplingRow per row ([n] int64 on logits' device, not waited for). temperatures: a list, or already [n] fp32
        on logits' device (checked when it was made)."""
        n = len(temperatures)
        if isinstance(temperatures, torch.Tensor):
            temps = temperatures
        else:
            assert min(temperatures, default=1.0) >= GREEDY_BELOW, "greedy rows take the argmax, not a softmax"
            temps = upload(temperatures, torch.float32, logits.device)
        probs = torch.softmax(logits[:n] / temps[:, None], dim=-1)
        return self.draw(probs, uniforms(seeds, counters))

    def draw(self, probs: torch.Tensor, us: Sequence[float] | np.ndarray) -> torch.Tensor:
        """Row i's token at quantile us[i] of probs[i] ([n] int64, on probs' device, not yet on the host).

        On an accelerator all rows are drawn in one batched pass (a per-row loop costs a device sync per row); on CPU
        row by row, where there is no sync to save and torch's 2-D fp64 cumsum is several times slower."""
        if probs.device.type == "cpu":
            values = us.tolist() if isinstance(us, np.ndarray) else us  # Python floats: torch then keeps float64 math
            return torch.tensor([inverse_cdf(probs[i], u) for i, u in enumerate(values)], dtype=torch.int64)
        u = torch.from_numpy(np.asarray(us, dtype=np.float64))
        return inverse_cdf_rows(probs, upload_tensor(u, probs.device))


def inverse_cdf(p: torch.Tensor, u: float) -> int:
    """The token at quantile u in [0, 1) of the (possibly unnormalised) distribution p: [vocab]."""
    if p.device.type != "cpu":
        # NOTE: on an accelerator every draw goes through the batched kernel, as Sampler.sample draws all rows at
        # once there: a verification's one-row draw must be the very token plain sampling would have drawn.
        return int(inverse_cdf_rows(p[None], torch.tensor([u], dtype=torch.float64, device=p.device))[0])
    cdf = torch.cumsum(p.double(), 0)  # sequential per row: the same bits in any batch
    idx = int(torch.searchsorted(cdf, (u * cdf[-1]).view(1), right=True))
    # NOTE: u < 1, but rounding can land u * total on the last step; never return a zero-probability token.
    if idx >= len(cdf) or p[idx] <= 0:
        idx = int(torch.nonzero(p > 0)[-1])
    return idx


def inverse_cdf_rows(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """inverse_cdf for every row at once: p [n, vocab] (unnormalised allowed), u [n] fp64 in [0, 1) -> [n] int64."""
    if p.shape[0] == 1 and p.device.type != "cpu":
        # NOTE: CUDA scans a lone row with another kernel (another summation order) than it scans rows of a batch;
        # padded to two rows, a one-row draw gives the bits the same row gets in any batch.
        return inverse_cdf_rows(torch.cat([p, torch.zeros_like(p)]), torch.cat([u, u]))[:1]
    cdf = torch.cumsum(p.double(), dim=-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    idx = idx.clamp_(max=p.shape[-1] - 1)
    # NOTE: as in inverse_cdf, a rounding step onto a zero-probability token falls back to the last positive one.
    last_positive = p.shape[-1] - 1 - (p.flip(-1) > 0).int().argmax(-1)
    bad = p.gather(1, idx[:, None]).squeeze(1) <= 0
    return torch.where(bad, last_positive, idx)


def uniform(seed: int, counter: int, stream: int = 0) -> float:
    """A uniform in [0, 1) that depends only on (seed, counter, stream): 53 bits of splitmix64.

    Stream 0 is the token sampled at output position `counter`; speculative verification draws its acceptance tests
    from other streams, so they never reuse the sampling draw.
    """
    if stream:  # salted, so a stream's seed is not stream 0's draw at output position `stream`
        seed = mix_seed(seed ^ _STREAM_SALT, stream)
    return (mix_seed(seed, counter) >> 10) / float(1 << 53)


_U64 = np.uint64


def _mix_seeds(seed: np.ndarray, counter: np.ndarray) -> np.ndarray:
    """mix_seed over uint64 arrays: numpy's uint64 arithmetic wraps modulo 2**64 as the masks above do."""
    z = seed * _U64(0x9E3779B97F4A7C15) + counter * _U64(0xBF58476D1CE4E5B9) + _U64(0x94D049BB133111EB)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return (z ^ (z >> _U64(31))) & _U64((1 << 63) - 1)


def uniforms(seeds: Sequence[int] | np.ndarray, counters: Sequence[int] | np.ndarray, stream: int = 0) -> np.ndarray:
    """uniform(seeds[i], counters[i], stream) for every i at once ([n] float64, the same bits).

    NOTE: per request and step the scalar version costs ~0.6 us of Python big-int arithmetic; a T = 1 step at
    C = 256 drew 256 of them, a drafting step K times more."""
    # NOTE: seeds are signed 64-bit (SamplingParams allows -2**63 ..): their two's-complement bits, as the scalar's
    # & _MASK64 takes them. np.array(-1, dtype=np.uint64) would raise instead.
    seed = np.asarray(seeds, dtype=np.int64).view(np.uint64)
    counter = np.asarray(counters, dtype=np.int64).view(np.uint64)
    if stream:
        seed = _mix_seeds(seed ^ _U64(_STREAM_SALT), np.full_like(seed, stream))
    return (_mix_seeds(seed, counter) >> _U64(10)).astype(np.float64) / float(1 << 53)


def _signed(value: int) -> int:
    """A uint64 constant as the int64 with its bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """uint64 >> bits on int64 tensors (torch's >> on int64 shifts in the sign bit)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix_seeds_t(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """_mix_seeds on int64 tensors: their products and sums wrap modulo 2**64 as uint64's do (two's complement)."""
    z = seed * _signed(0x9E3779B97F4A7C15) + counter * _signed(0xBF58476D1CE4E5B9) + _signed(0x94D049BB133111EB)
    z = (z ^ _shr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _signed(0x94D049BB133111EB)
    return (z ^ _shr(z, 31)) & ((1 << 63) - 1)


def uniforms_t(seeds: torch.Tensor, counters: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """uniforms() computed where the tensors are (int64 seeds and counters of any shape -> float64, the same bits), so
    that a step whose counters exist only on the device (a request's output length after a verification the host has
    not read yet) can draw without the host. NOTE: not used by the engine yet: it is the first piece of a pipelined
    speculative step (issue 6, session 8's note)."""
    seed = seeds.to(torch.int64)
    if stream:
        seed = _mix_seeds_t(seed ^ _signed(_STREAM_SALT), torch.full_like(seed, stream))
    return (_mix_seeds_t(seed, counters.to(torch.int64)) >> 10).to(torch.float64) / float(1 << 53)


def _penalised(r: SamplingRow) -> bool:
    return bool(r.presence_penalty or r.frequency_penalty or r.repetition_penalty != 1.0)


def _apply_penalties(row: torch.Tensor, r: SamplingRow) -> None:
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
