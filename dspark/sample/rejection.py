"""Lossless verification of drafted tokens, each request with its own number of drafts (0..K) plus one bonus.

For request r with drafts x_1..x_l, target distributions p_1..p_{l+1} (ops.logits_to_probs of the target's logits,
as the non-speculative sampler computes them) and, for probabilistic drafters, draft distributions q_1..q_l:

- greedy (temperature 0): accept x_k while x_k = argmax p_k; the first mismatch emits argmax p_k instead.
- probabilistic (Leviathan et al. / Chen et al.): accept x_k with probability min(1, p_k(x_k) / q_k(x_k)); on
  rejection emit a sample of normalise(max(p_k - q_k, 0)). Every emitted token is then distributed exactly as p.
- strict (drafters without probabilities, e.g. n-gram): emit the token the non-speculative sampler would draw at
  that position (same seed, same output index, same uniform) and accept x_k only if it is that token. Seeded
  output is then identical with and without speculation, not just equal in distribution.

When all l drafts are accepted, the bonus token is sampled from p_{l+1} as the plain sampler would.

Randomness is counter-based (sample/random.py): output position n of a request uses uniform(seed, n) for sampling,
and separate streams for the acceptance test and the residual draw, so results do not depend on the batch.
Whether a draft is verified at all must not depend on its value (the scheduler's job, docs/scheduling.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark.sample.ops import softmax_temperatures, temperature_probs
from dspark.sample.random import (
    ACCEPT_STREAM,
    RESIDUAL_STREAM,
    SAMPLE_STREAM,
    draw,
    inverse_cdf,
    stream_seeds,
    uniform,
    uniforms,
    uniforms_at,
)
from dspark.utils.transfer import download, upload, upload_tensor

METHODS = ("probabilistic", "strict")
VERIFY_STREAMS = (SAMPLE_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM)  # the columns of verify_on_device's stream_keys


@dataclass
class VerifyRow:
    """One request's drafts in this step."""

    seed: int
    first_counter: int  # output index of the first drafted token
    draft_tokens: list[int]
    greedy: bool = False


def verify(
    target_probs: torch.Tensor,  # [sum(l_r + 1), vocab]: rows of request r are back to back, bonus row last
    draft_probs: torch.Tensor | None,  # [sum(l_r), vocab], rows back to back; None for strict verification
    rows: list[VerifyRow],
    method: str = "probabilistic",
) -> list[list[int]]:
    """The tokens each request emits this step: its accepted drafts, then one corrected or bonus token."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}: one of {', '.join(METHODS)}")
    if method == "probabilistic" and draft_probs is None and not all(r.greedy for r in rows):
        raise ValueError("probabilistic verification of sampled rows needs the draft distributions")
    expected = sum(len(r.draft_tokens) + 1 for r in rows)
    if target_probs.shape[0] != expected:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows, the drafts need {expected}")
    num_drafts = sum(len(r.draft_tokens) for r in rows)
    if draft_probs is not None and method == "probabilistic" and draft_probs.shape[0] != num_drafts:
        raise ValueError(f"draft_probs has {draft_probs.shape[0]} rows, the drafts need {num_drafts}")
    # Everything a row's decisions read is computed up front in batched kernels and reaches the host in one
    # copy: the argmax of every row, the token plain sampling would draw at every row (strict verification and the
    # bonus), and p(x), q(x) of every draft. Only the residual draws of rejected drafts need a second copy.
    t_index, d_index, tokens, seeds, counters = [], [], [], [], []
    t_row = d_row = 0
    for r in rows:
        t_index += range(t_row, t_row + len(r.draft_tokens))
        d_index += range(d_row, d_row + len(r.draft_tokens))
        tokens += r.draft_tokens
        seeds += [r.seed] * (len(r.draft_tokens) + 1)
        counters += range(r.first_counter, r.first_counter + len(r.draft_tokens) + 1)
        t_row += len(r.draft_tokens) + 1
        d_row += len(r.draft_tokens)
    dev = target_probs.device
    needed = [target_probs.argmax(dim=-1)]
    # On CPU there is no sync to save: plain draws are made lazily, only for the rows a decision reaches.
    batched = not all(r.greedy for r in rows) and dev.type != "cpu"
    if batched:  # every row's plain draw (greedy rows' too: they read the argmax instead)
        needed.append(draw(target_probs, uniforms(seeds, counters)))
    probabilistic = method == "probabilistic" and bool(tokens) and draft_probs is not None
    if probabilistic:
        x = upload(tokens, torch.int64, dev)
        needed.append(target_probs[upload(t_index, torch.int64, dev), x])
        needed.append(draft_probs[upload(d_index, torch.int64, dev), x])  # type: ignore[index]
    host = download(*needed)
    tops = host[0]
    plain_host = host[1] if batched else None

    def plain(row: int) -> int:
        if plain_host is not None:
            return plain_host[row]
        return inverse_cdf(target_probs[row], uniform(seeds[row], counters[row]))

    p_at, q_at = (host[-2], host[-1]) if probabilistic else ([], [])

    out: list[list[int]] = []
    residuals: list[tuple[int, int, int, int]] = []  # (request, target row, draft row, output index) to redraw
    t_row = d_row = 0
    for i, r in enumerate(rows):
        emitted: list[int] = []
        for k, x_k in enumerate(r.draft_tokens):
            n = r.first_counter + k
            if r.greedy:
                choice = tops[t_row + k]
                accept = choice == x_k
            elif method == "strict":
                choice = plain(t_row + k)
                accept = choice == x_k
            else:
                # NOTE: u * q < p rather than u < p / q: exact when q(x) = 0 (a draft the drafter could not have
                # proposed is always accepted only if the target allows it).
                accept = uniform(r.seed, n, ACCEPT_STREAM) * q_at[d_row + k] < p_at[d_row + k]
                choice = x_k
                if not accept:
                    residuals.append((i, t_row + k, d_row + k, n))
            emitted.append(choice)
            if not accept:  # a rejection ends the row even if the correction happens to equal the draft
                break
        else:  # every draft accepted: the bonus token, drawn as plain sampling would draw it
            b = t_row + len(r.draft_tokens)
            emitted.append(tops[b] if r.greedy else plain(b))
        out.append(emitted)
        t_row += len(r.draft_tokens) + 1
        d_row += len(r.draft_tokens)
    if residuals:  # every rejection's correction at once: a sample of normalise(max(p - q, 0))
        assert draft_probs is not None
        drawn = _residuals(target_probs, draft_probs, residuals, {i: rows[i].seed for i, *_ in residuals})
        for (i, *_), token in zip(residuals, drawn, strict=True):
            out[i][-1] = token
    return out


def _residuals(
    p: torch.Tensor, q: torch.Tensor, rejected: list[tuple[int, int, int, int]], seeds: dict[int, int]
) -> list[int]:
    dev = p.device
    t_rows = upload([t for _, t, _, _ in rejected], torch.int64, dev)
    d_rows = upload([d for _, _, d, _ in rejected], torch.int64, dev)
    residual = (p[t_rows].double() - q[d_rows].double()).clamp_(min=0.0)
    # p == q: a rejection has probability 0; guard the rounding case by drawing from p itself.
    empty = residual.sum(dim=-1, keepdim=True) <= 0.0
    residual = torch.where(empty, p[t_rows].double(), residual)
    us = uniforms([seeds[i] for i, *_ in rejected], [n for *_, n in rejected], RESIDUAL_STREAM)
    return download(draw(residual, us))[0]


def verify_plain(
    logits: torch.Tensor,  # [>= sum(l_r + 1), vocab] fp32 raw logits: rows of request r back to back, bonus row last
    draft_probs: torch.Tensor | None,  # [sum(l_r), vocab]; None for strict verification or all-greedy rows
    rows: list[VerifyRow],
    temperatures: list[float],  # per request (greedy rows' is not read)
    method: str = "probabilistic",
) -> tuple[torch.Tensor, torch.Tensor]:
    """verify() for requests whose sampling is a temperature alone or greedy (no top-k/p, min-p, penalties, banned
    tokens): the same tokens as verify(logits_to_probs(logits, rows), ...), decided on the device in batched kernels
    (verify_on_device). Returns (drafts accepted [R], the corrected or bonus token [R]), int64 on logits' device, not
    waited for: request r emits draft_tokens[:accepted] and then that token.

    verify() decides row by row on the host; here the host only lays out index arrays (numpy) in one upload, and every
    decision reads the same values (the softmax of the same rows, the same fp64 products and draws) as verify(), so
    the tokens are the same bits: each draw scans its own row, whatever other rows are drawn beside it."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}: one of {', '.join(METHODS)}")
    greedy = np.array([r.greedy for r in rows], dtype=bool)
    if method == "probabilistic" and draft_probs is None and not greedy.all():
        raise ValueError("probabilistic verification of sampled rows needs the draft distributions")
    if len(temperatures) != len(rows):
        raise ValueError(f"{len(temperatures)} temperatures for {len(rows)} requests")
    num_reqs = len(rows)
    lens = np.array([len(r.draft_tokens) for r in rows], dtype=np.int64)
    num_drafts = int(lens.sum())
    n = num_drafts + num_reqs
    if logits.shape[0] < n:
        raise ValueError(f"logits has {logits.shape[0]} rows, the drafts need {n}")
    if draft_probs is not None and method == "probabilistic" and draft_probs.shape[0] != num_drafts:
        raise ValueError(f"draft_probs has {draft_probs.shape[0]} rows, the drafts need {num_drafts}")
    k = max(1, int(lens.max(initial=0)))
    t_start = np.concatenate([[0], np.cumsum(lens + 1)[:-1]]).astype(np.int64)
    d_start = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    j = np.arange(k, dtype=np.int64)
    valid = j[None, :] < lens[:, None]  # [R, k]: the verified positions
    # Padding positions point at a real row (the last draft row) and are masked by the drafts' count.
    d_index = np.minimum(
        d_start[:, None] + np.minimum(j[None, :], np.maximum(lens - 1, 0)[:, None]), max(num_drafts - 1, 0)
    )
    drafts = np.zeros((num_reqs, k), dtype=np.int64)
    if num_drafts:
        drafts[valid] = np.concatenate([r.draft_tokens for r in rows if r.draft_tokens])
    owner = np.repeat(np.arange(num_reqs), lens + 1)
    offset = np.arange(n) - t_start[owner]
    keys = stream_seeds([r.seed for r in rows], VERIFY_STREAMS)
    firsts = [r.first_counter for r in rows]
    # Everything the device needs in two copies (one int64, one fp32), sliced there, not a dozen uploads (each its own
    # pinned staging copy and transfer: a fixed host cost that matters most for small batches).
    ints = _Packed([t_start, lens, drafts, greedy, keys, firsts, d_index, owner, offset], np.int64)
    dev = logits.device
    ints_dev = ints.upload(dev)
    row_start, num, x, greedy_dev, keys_dev, firsts_dev, d_dev, owner_dev, offset_dev = (
        ints.part(ints_dev, i) for i in range(9)
    )
    sampled = not greedy.all()
    temps = upload(softmax_temperatures(temperatures), torch.float32, dev) if sampled else None
    return verify_on_device(
        logits[:n],
        row_start,
        num,
        x.view(num_reqs, k),
        greedy_dev != 0,
        temps,
        keys_dev.view(num_reqs, len(VERIFY_STREAMS)),
        firsts_dev,
        draft_probs if method == "probabilistic" else None,
        d_dev.view(num_reqs, k),
        owner_dev,
        offset_dev,
        method,
    )


def verify_on_device(
    logits: torch.Tensor,  # [T, vocab] fp32 raw logits of the step (rows past the requests' are padding)
    row_start: torch.Tensor,  # [R] int64: request r's first row (its draft rows, then its bonus row, back to back)
    num_drafts: torch.Tensor,  # [R] int64: drafts request r verifies, 0..k
    drafts: torch.Tensor,  # [R, k] int64 (positions past num_drafts are not read)
    greedy: torch.Tensor,  # [R] bool
    temperatures: torch.Tensor | None,  # [R] fp32 softmax_temperatures(); None: every request is greedy
    stream_keys: torch.Tensor,  # [R, 3] int64: random.stream_seeds(seeds, VERIFY_STREAMS)
    first_counters: torch.Tensor,  # [R] int64: the output index of request r's first draft
    draft_probs: torch.Tensor | None,  # [N, vocab]: what each draft was drawn from (probabilistic, sampled requests)
    draft_index: torch.Tensor,  # [R, k] int64: the row of draft_probs of request r's draft j
    row_owner: torch.Tensor,  # [T] int64: the request each logits row belongs to (padding rows: any request)
    row_offset: torch.Tensor,  # [T] int64: the row's index among its request's rows
    method: str = "probabilistic",
    iota: torch.Tensor | None = None,  # arange of at least 2k + 1 on logits' device, where the caller keeps one
) -> tuple[torch.Tensor, torch.Tensor]:
    """The verification decisions on device inputs only: (drafts accepted [R], the corrected or bonus token [R]),
    int64 on logits' device. Shapes are fixed by the inputs' and no value is read on the host, so a CUDA graph can
    capture it (the pipelined speculative step builds these inputs on the device as well)."""
    k = drafts.shape[1]
    if iota is None:
        iota = torch.arange(2 * k + 1, device=logits.device)
    assert iota.numel() >= 2 * k + 1, (iota.numel(), k)  # a slice past the end would be short, silently
    j = iota[: k + 1]
    # [R, k + 1]: the row of each position, draft j for j < num_drafts and the bonus row from num_drafts on. An empty
    # (padding) request starts where the real rows end, which can be past the last row: clamped, and never read.
    last_row = logits.shape[0] - 1
    t_index = (row_start[:, None] + torch.minimum(j[None, :], num_drafts[:, None])).clamp_(max=last_row)
    valid = j[None, :k] < num_drafts[:, None]
    tops = logits.argmax(dim=-1)
    choice = tops[t_index]  # what greedy verification compares each draft with, and emits instead
    if temperatures is None:
        accept = (choice[:, :k] == drafts) & valid
        num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
        return num_accepted, choice.gather(1, num_accepted[:, None]).squeeze(1)
    probs = temperature_probs(logits, temperatures[row_owner])  # logits_to_probs's distribution of every row
    if method == "strict":
        # every row's plain draw (the token plain sampling would draw there): what a sampled draft must equal
        u = uniforms_at(stream_keys[row_owner, 0], first_counters[row_owner] + row_offset)
        choice = torch.where(greedy[row_owner], tops, draw(probs, u))[t_index]
        accept = (choice[:, :k] == drafts) & valid
        num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
        return num_accepted, choice.gather(1, num_accepted[:, None]).squeeze(1)
    assert draft_probs is not None, "probabilistic verification of sampled rows needs the draft distributions"
    if draft_probs.shape[0] == 0:  # no drafts at all: every index points at a zero row, and nothing reads it
        draft_probs = draft_probs.new_zeros(1, logits.shape[1])
    # Every uniform the step may read, in one hash over [R, 2k + 1] (each op of a step is a kernel, and a hash is a
    # dozen): the acceptance test of each draft, the residual draw at each position (the one read is the first
    # rejection's) and the bonus draw. The values are uniforms() of the same (seed, output index, stream).
    num_reqs = drafts.shape[0]
    column = iota[: 2 * k + 1]
    counters = first_counters[:, None] + torch.where(column < 2 * k, column % k, num_drafts[:, None])
    keys = torch.cat(
        [stream_keys[:, 1:2].expand(num_reqs, k), stream_keys[:, 2:3].expand(num_reqs, k), stream_keys[:, :1]], 1
    )
    u = uniforms_at(keys, counters)
    # NOTE: u * q < p in fp64, as verify() compares Python floats (exact when q(x) = 0).
    p_x = probs[t_index[:, :k], drafts].double()
    q_x = draft_probs[draft_index, drafts].double()
    accept = torch.where(greedy[:, None], choice[:, :k] == drafts, u[:, :k] * q_x < p_x) & valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    all_accepted = (num_accepted == num_drafts)[:, None]
    at = num_accepted.clamp(max=k - 1)[:, None]
    # A request ends its emitted run with one draw: the bonus row's plain draw where every draft was accepted, else
    # the first rejection's correction, a sample of normalise(max(p - q, 0)). t_index at num_accepted is the row
    # either reads (the bonus row, or the rejected draft's: num_accepted < num_drafts <= k), and the residual is
    # computed for every request (fixed shapes) and drawn from where it applies. fp64 rows hold p's fp32 values
    # exactly, so a bonus token is the bits plain sampling draws.
    p_end = probs[t_index.gather(1, num_accepted[:, None]).squeeze(1)].double()
    residual = (p_end - draft_probs[draft_index.gather(1, at).squeeze(1)].double()).clamp_(min=0.0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) <= 0.0, p_end, residual)
    final = torch.where(all_accepted, p_end, residual)
    u_final = torch.where(all_accepted, u[:, 2 * k :], u[:, k : 2 * k].gather(1, at)).squeeze(1)
    return num_accepted, torch.where(greedy, choice.gather(1, num_accepted[:, None]).squeeze(1), draw(final, u_final))


class _Packed:
    """Host arrays laid end to end for one upload, then sliced apart on the device."""

    def __init__(self, parts: list[np.ndarray], dtype: type) -> None:
        flat = [np.asarray(a).reshape(-1).astype(dtype, copy=False) for a in parts]
        self.offsets = np.concatenate([[0], np.cumsum([a.size for a in flat])]).tolist()
        self.host = np.concatenate(flat) if flat else np.zeros(0, dtype=dtype)

    def upload(self, device: torch.device) -> torch.Tensor:
        return upload_tensor(torch.from_numpy(self.host), device)

    def part(self, on_device: torch.Tensor, i: int) -> torch.Tensor:
        return on_device[self.offsets[i] : self.offsets[i + 1]]
