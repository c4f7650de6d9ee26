"""The low-rank Markov head and the left-to-right sampling of a block's drafts.

The backbone predicts all K positions of a block at once, so on its own each draft ignores the drafts before it.
The Markov head adds a first-order correction: logits_k = lm_head(h_k) + W2 W1[x_{k-1}], with x_0 the anchor, and
drafts are sampled one position at a time. The corrected distribution is the one each draft is sampled from, so it is
also the draft distribution that rejection sampling needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark.spec.dspark.confidence import ConfidenceHead
from dspark.worker.sampler import inverse_cdf_rows, uniform
from dspark.worker.transfer import upload, upload_tensor

DRAFT_STREAM = 3  # the counter-based stream drafts are sampled from (0-2 belong to sampling and verification)


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # weight [V, r]: a small embedding of the previous token
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # weight [V, r]

    def forward(self, prev_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev_tokens: [n] -> (W1[x], [n, rank]; the logit correction W2 W1[x], [n, vocab] fp32)."""
        e = self.markov_w1(prev_tokens)
        return e, self.markov_w2(e).float()


@dataclass
class DraftRow:
    """How one request drafts: its seed and output index (for counter-based draws) and its temperature."""

    seed: int
    first_counter: int
    temperature: float
    greedy: bool


@dataclass
class BlockDrafts:
    tokens: torch.Tensor  # [R, k] int64
    probs: torch.Tensor | None  # [R, k, vocab] fp32, the distribution each draft was drawn from
    confidence_logits: torch.Tensor | None  # [R, k] fp32


def sample_block(
    base_logits: torch.Tensor,  # [R_pad, k, vocab] fp32: lm_head of the backbone's states (rows past R: padding)
    h: torch.Tensor,  # [R_pad, k, hidden]
    anchors: torch.Tensor,  # [R_pad] int64
    head: MarkovHead | None,  # None: no Markov correction (the drafts come from the backbone alone)
    confidence: ConfidenceHead | None,
    rows: list[DraftRow],
    sample: bool,  # False: every draft is the argmax (no distribution is returned)
) -> BlockDrafts:
    num_reqs, k = len(rows), base_logits.shape[1]
    prev = anchors
    tokens, probs, conf = [], [], []
    temps = upload([1.0 if r.greedy else r.temperature for r in rows], torch.float32, h.device)
    greedy = upload([r.greedy for r in rows], torch.bool, h.device)
    if sample:  # every draw of the block at once, before the loop: [R, k]
        u_all = upload_tensor(
            torch.tensor(
                [[uniform(r.seed, r.first_counter + j, DRAFT_STREAM) for j in range(k)] for r in rows],
                dtype=torch.float64,
            ),
            h.device,
        )
    for j in range(k):
        if head is not None:
            e, correction = head(prev)
            logits = base_logits[:, j] + correction  # [R_pad, vocab]
        else:
            e, logits = h.new_zeros(h.shape[0], 0), base_logits[:, j]
        if confidence is not None:
            conf.append(confidence.logit(h[:, j], e)[:num_reqs])
        top = torch.argmax(logits[:num_reqs], dim=-1)
        if sample:
            q = torch.softmax(logits[:num_reqs] / temps[:, None], dim=-1)
            # NOTE: torch.where, not q[greedy] = ...: boolean indexing waits for the device to count the mask.
            q = torch.where(greedy[:, None], torch.nn.functional.one_hot(top, q.shape[-1]).to(q.dtype), q)
            x = torch.where(greedy, top, inverse_cdf_rows(q, u_all[:, j]))
            probs.append(q)
        else:
            x = top
        tokens.append(x)
        prev = torch.cat([x, prev[num_reqs:]])  # padding rows keep their (ignored) anchors
    return BlockDrafts(
        tokens=torch.stack(tokens, dim=1),
        probs=torch.stack(probs, dim=1) if sample else None,
        confidence_logits=torch.stack(conf, dim=1) if confidence is not None else None,
    )
