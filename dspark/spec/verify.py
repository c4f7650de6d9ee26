"""Lossless verification of drafted tokens, each request with its own number of drafts (0..K) plus one bonus.

For request r with drafts x_1..x_l, target distributions p_1..p_{l+1} (already shaped by temperature, top-k/p,
min-p and penalties exactly as the non-speculative sampler shapes them) and, for probabilistic drafters, draft
distributions q_1..q_l:

- greedy (temperature 0): accept x_k while x_k = argmax p_k; the first mismatch emits argmax p_k instead.
- probabilistic (Leviathan et al. / Chen et al.): accept x_k with probability min(1, p_k(x_k) / q_k(x_k)); on
  rejection emit a sample of normalise(max(p_k - q_k, 0)). Every emitted token is then distributed exactly as p.
- strict (drafters without probabilities, e.g. n-gram): emit the token the non-speculative sampler would draw at
  that position (same seed, same output index, same uniform) and accept x_k only if it is that token. Seeded
  output is then identical with and without speculation, not just equal in distribution.

When all l drafts are accepted, the bonus token is sampled from p_{l+1} as the plain sampler would.

Randomness is counter-based (worker/sampler.py): output position n of a request uses uniform(seed, n) for sampling,
and separate streams for the acceptance test and the residual draw, so results do not depend on the batch.
Whether a draft is verified at all must not depend on its value (the scheduler's job, DESIGN.md section 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.worker.sampler import Sampler, inverse_cdf, uniform, uniforms
from dspark.worker.transfer import download, upload

METHODS = ("probabilistic", "strict")
ACCEPT_STREAM = 1
RESIDUAL_STREAM = 2


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
        needed.append(_SAMPLER.draw(target_probs, uniforms(seeds, counters)))
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


_SAMPLER = Sampler()


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
    return download(_SAMPLER.draw(residual, us))[0]
