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
Whether a draft is verified at all must not depend on its value (the scheduler's job, DESIGN.md section 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark.sample.ops import softmax_temperatures, temperature_probs
from dspark.sample.random import ACCEPT_STREAM, RESIDUAL_STREAM, draw, inverse_cdf, uniform, uniforms
from dspark.utils.transfer import download, upload, upload_tensor

METHODS = ("probabilistic", "strict")


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
    # NOTE: everything a row's decisions read is computed up front in batched kernels and reaches the host in one
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
    tokens): the same tokens as verify(logits_to_probs(logits, rows), ...), decided on the device in batched
    kernels. Returns (drafts accepted [R], the corrected or bonus token [R]), int64 on logits' device, not waited for:
    request r emits draft_tokens[:accepted] and then that token.

    NOTE: verify() decides row by row on the host: a SamplingRow per verified position, a Python loop over every
    draft with two scalar uniforms each, and a second device round trip for the residual draws. At C = 256 and
    k = 7 that is ~2000 positions a step. Here the host only lays out index arrays (numpy) and uniforms; every
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
    # Padding positions point at a real row (the bonus row; the last draft row) and are masked by `valid`.
    t_index = t_start[:, None] + np.minimum(j[None, :], lens[:, None])
    d_index = np.minimum(
        d_start[:, None] + np.minimum(j[None, :], np.maximum(lens - 1, 0)[:, None]), max(num_drafts - 1, 0)
    )
    drafts = np.zeros((num_reqs, k), dtype=np.int64)
    if num_drafts:
        drafts[valid] = np.concatenate([r.draft_tokens for r in rows if r.draft_tokens])
    seeds = np.array([r.seed for r in rows], dtype=np.int64)
    firsts = np.array([r.first_counter for r in rows], dtype=np.int64)
    bonus = t_start + lens
    sampled = ~greedy
    # The rows a plain draw is read at: every row of a sampled request under strict verification, only its bonus row
    # under probabilistic (greedy requests read the argmax).
    if not sampled.any():
        need = np.zeros(0, dtype=np.int64)
    elif method == "strict":
        need = np.concatenate([np.arange(t_start[r], bonus[r] + 1) for r in np.flatnonzero(sampled)])
    else:
        need = bonus[sampled]
    req_of = np.repeat(np.arange(num_reqs), lens + 1)[need]
    residual_reqs = np.flatnonzero(sampled & (lens > 0)) if method == "probabilistic" else np.zeros(0, np.int64)
    # NOTE: everything the device needs in two copies (one int64, one fp64), sliced there, not a dozen uploads (each its
    # own pinned staging copy and transfer, a fixed host cost that matters most at C = 1).
    ints = _Packed([t_index, drafts, valid, d_index, lens, bonus, sampled, need, residual_reqs], np.int64)
    floats = [
        np.repeat(softmax_temperatures(temperatures), lens + 1),
        uniforms(seeds[req_of], firsts[req_of] + (need - t_start[req_of])),
    ]
    if residual_reqs.size:
        floats.append(uniforms(np.repeat(seeds, k), (firsts[:, None] + j).reshape(-1), ACCEPT_STREAM))
        counters = (firsts[residual_reqs, None] + j).reshape(-1)
        floats.append(uniforms(np.repeat(seeds[residual_reqs], k), counters, RESIDUAL_STREAM))
    fl = _Packed(floats, np.float64)
    dev = logits.device
    ints_dev, fl_dev = ints.upload(dev), fl.upload(dev)
    t_dev, x, valid_dev, d_dev, lens_dev, bonus_dev, sampled_dev, need_dev, residual_dev = (
        ints.part(ints_dev, i) for i in range(9)
    )
    t_dev, x, valid_dev, d_dev = (t.view(num_reqs, k) for t in (t_dev, x, valid_dev, d_dev))

    tops = logits[:n].argmax(dim=-1)
    plain = tops
    probs = None
    if sampled.any():
        # logits_to_probs's distribution for these rows (greedy rows' is not read: they read the argmax)
        probs = temperature_probs(logits[:n], fl.part(fl_dev, 0).float())
        plain = tops.clone()
        plain[need_dev] = draw(probs[need_dev], fl.part(fl_dev, 1))
    choice = plain[t_dev]  # [R, k]: what greedy and strict verification compare each draft with, and emit instead
    accept = choice == x
    if residual_reqs.size:
        assert draft_probs is not None and probs is not None
        # NOTE: u * q < p in fp64, as verify() compares Python floats (exact when q(x) = 0).
        p_x = probs[t_dev, x].double()
        q_x = draft_probs[d_dev, x].double()
        by_ratio = fl.part(fl_dev, 2).view(num_reqs, k) * q_x < p_x
        accept = torch.where(sampled_dev[:, None] != 0, by_ratio, accept)
    accept &= valid_dev != 0
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # the leading run of acceptances
    at = num_accepted.clamp(max=k - 1)[:, None]
    corrected = choice.gather(1, at).squeeze(1)
    if residual_reqs.size:
        assert draft_probs is not None and probs is not None
        # The rejections' corrections, a sample of normalise(max(p - q, 0)) at the first rejected position, drawn for
        # every sampled request that verified drafts (those that accepted all of them do not read theirs).
        at_sub = at[residual_dev]
        t_rej = t_dev[residual_dev].gather(1, at_sub).squeeze(1)
        d_rej = d_dev[residual_dev].gather(1, at_sub).squeeze(1)
        p_rej = probs[t_rej].double()
        residual = (p_rej - draft_probs[d_rej].double()).clamp_(min=0.0)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) <= 0.0, p_rej, residual)
        u_rej = fl.part(fl_dev, 3).view(-1, k).gather(1, at_sub).squeeze(1)
        corrected[residual_dev] = draw(residual, u_rej)
    last = torch.where(num_accepted == lens_dev, plain[bonus_dev], corrected)
    return num_accepted, last


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
