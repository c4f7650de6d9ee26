"""Counter-based randomness: every draw is a uniform computed from (request seed, output position, stream) alone, and a
token is drawn by inverting its row's CDF at that uniform.

No generator state is carried, so batch composition, preemption and recompute never change what a request draws, and
a token drawn by speculative verification is the very token plain sampling would have drawn at that position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dspark.utils.transfer import upload_tensor

# A request's streams: one per use of a draw at output position n, so that no use reuses another's uniform.
SAMPLE_STREAM = 0  # the token at n: plain sampling, strict verification, the bonus token
ACCEPT_STREAM = 1  # probabilistic verification's acceptance test of the draft at n
RESIDUAL_STREAM = 2  # the correction drawn when that draft is rejected
DRAFT_STREAM = 3  # the DSpark drafter's draft at n

_MASK64 = (1 << 64) - 1
_STREAM_SALT = 0x5DEECE66D2F1A7B3
_U64 = np.uint64


def mix_seed(seed: int, counter: int) -> int:
    """splitmix64 of (seed, counter): independent streams per request and per output position."""
    z = (seed * 0x9E3779B97F4A7C15 + counter * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def uniform(seed: int, counter: int, stream: int = SAMPLE_STREAM) -> float:
    """A uniform in [0, 1) that depends only on (seed, counter, stream): 53 bits of splitmix64."""
    if stream:  # salted, so a stream's seed is not stream 0's draw at output position `stream`
        seed = mix_seed(seed ^ _STREAM_SALT, stream)
    return (mix_seed(seed, counter) >> 10) / float(1 << 53)


def _mix_seeds(seed: np.ndarray, counter: np.ndarray) -> np.ndarray:
    """mix_seed over uint64 arrays: numpy's uint64 arithmetic wraps modulo 2**64 as the masks above do."""
    z = seed * _U64(0x9E3779B97F4A7C15) + counter * _U64(0xBF58476D1CE4E5B9) + _U64(0x94D049BB133111EB)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return (z ^ (z >> _U64(31))) & _U64((1 << 63) - 1)


def uniforms(
    seeds: Sequence[int] | np.ndarray, counters: Sequence[int] | np.ndarray, stream: int = SAMPLE_STREAM
) -> np.ndarray:
    """uniform(seeds[i], counters[i], stream) for every i at once ([n] float64, the same bits), without Python big-int
    arithmetic per request."""
    # NOTE: seeds are signed 64-bit (SamplingParams allows -2**63 ..): their two's-complement bits, as the scalar's
    # & _MASK64 takes them. np.array(-1, dtype=np.uint64) would raise instead.
    seed = np.asarray(seeds, dtype=np.int64).view(np.uint64)
    counter = np.asarray(counters, dtype=np.int64).view(np.uint64)
    if stream:
        seed = _mix_seeds(seed ^ _U64(_STREAM_SALT), np.full_like(seed, stream))
    return (_mix_seeds(seed, counter) >> _U64(10)).astype(np.float64) / float(1 << 53)


def stream_seeds(seeds: Sequence[int] | np.ndarray, streams: Sequence[int]) -> np.ndarray:
    """[n, len(streams)] int64: each seed's key for each stream, such that uniforms_at(keys[:, j], counters) is
    uniforms(seeds, counters, streams[j]). A request's keys are fixed, so a device step can hold them and hash each
    uniform once instead of salting its seed again at every draw."""
    seed = np.asarray(seeds, dtype=np.int64).view(np.uint64)
    keys = [_mix_seeds(seed ^ _U64(_STREAM_SALT), np.full_like(seed, s)) if s else seed.copy() for s in streams]
    return np.stack(keys, axis=1).view(np.int64).reshape(len(seed), len(streams))


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


def uniforms_at(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """uniforms() computed where the tensors are, from a stream's keys (stream_seeds(); a SAMPLE_STREAM key is the
    seed itself): int64 keys and counters of any shape -> float64, the same bits. A step whose counters exist only on
    the device (a request's output length after a verification the host has not read yet) draws without the host:
    pipelined speculative steps (worker/spec_pipeline.py, rejection.verify_on_device) do, every stream's uniforms in
    one hash over their keys and counters side by side."""
    return (_mix_seeds_t(keys, counters.to(torch.int64)) >> 10).to(torch.float64) / float(1 << 53)


def inverse_cdf(p: torch.Tensor, u: float) -> int:
    """The token at quantile u in [0, 1) of the (possibly unnormalised) distribution p: [vocab]."""
    if p.device.type != "cpu":
        # NOTE: on an accelerator every draw goes through the batched kernel, as draw() draws all rows at once there:
        # a verification's one-row draw must be the very token plain sampling would have drawn.
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
    # As in inverse_cdf, a rounding step onto a zero-probability token falls back to the last positive one.
    # NOTE: compared, then flipped: the flip copies a byte an entry, not p's eight.
    last_positive = p.shape[-1] - 1 - (p > 0).flip(-1).int().argmax(-1)
    bad = p.gather(1, idx[:, None]).squeeze(1) <= 0
    return torch.where(bad, last_positive, idx)


def draw(
    probs: torch.Tensor,  # [n, vocab], unnormalised allowed
    u: torch.Tensor | np.ndarray | Sequence[float],  # [n] float64 in [0, 1): host values, or already on probs' device
) -> torch.Tensor:
    """Row i's token at quantile u[i] of probs[i] ([n] int64 on probs' device, not waited for).

    On an accelerator all rows are drawn in one batched pass (a per-row loop costs a device sync per row); on CPU
    row by row, where there is no sync to save and torch's 2-D fp64 cumsum is several times slower."""
    if probs.device.type == "cpu":
        # Python floats: torch then keeps float64 math
        values = u.tolist() if isinstance(u, (torch.Tensor, np.ndarray)) else u
        return torch.tensor([inverse_cdf(probs[i], x) for i, x in enumerate(values)], dtype=torch.int64)
    if not isinstance(u, torch.Tensor):
        u = upload_tensor(torch.from_numpy(np.asarray(u, dtype=np.float64)), probs.device)
    return inverse_cdf_rows(probs, u)
