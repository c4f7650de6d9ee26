"""The low-rank Markov head and the left-to-right sampling of a block's drafts.

The backbone predicts all K positions of a block at once, so on its own each draft ignores the drafts before it.
The Markov head adds a first-order correction: logits_k = lm_head(h_k) + W2 W1[x_{k-1}], with x_0 the anchor, and
drafts are sampled one position at a time. The corrected distribution is the one each draft is sampled from, so it is
also the draft distribution that rejection sampling needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dspark.kernels import cpu as cpu_kernels
from dspark.sample.ops import softmax_temperatures, temperature_probs
from dspark.sample.random import DRAFT_STREAM, inverse_cdf_rows, uniforms
from dspark.speculative.drafters.dspark import draw_kernel
from dspark.speculative.drafters.dspark.confidence import ConfidenceHead
from dspark.utils.transfer import upload, upload_tensor


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # weight [V, r]: a small embedding of the previous token
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # weight [V, r]
        self.w2t: torch.Tensor | None = None  # [r, V]: the fast CPU path's greedy drafts (pack_for_cpu)

    def pack_for_cpu(self) -> None:
        """The fast CPU path (models.llama.use_fast_cpu_path): greedy blocks through cpu_kernels.markov_block, which
        reads W2 transposed. At batch 1 each position's GEMM, add and argmax took ~0.3 ms on the 2-vCPU machine, 2 ms
        of a ~40 ms drafting step. A copy: the parameter stays what training and state_dict read."""
        w = self.markov_w2.weight.detach()
        with torch.inference_mode():
            if cpu_kernels.supports(w) and w.shape[1] <= 256:
                self.w2t = w.t().contiguous()

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
    temps, greedy, u_all = draw_inputs(rows, base_logits.shape[1], sample, h.device)
    return sample_block_with(base_logits, h, anchors, head, confidence, temps, greedy, u_all)


def draft_uniforms(rows: list[DraftRow], k: int) -> np.ndarray:
    """[R, k] float64: the uniform of each row's j-th draft, uniform(seed, first_counter + j, DRAFT_STREAM)."""
    seeds = np.repeat(np.array([r.seed for r in rows], dtype=np.int64), k)
    counters = (np.array([r.first_counter for r in rows], dtype=np.int64)[:, None] + np.arange(k)).reshape(-1)
    return uniforms(seeds, counters, DRAFT_STREAM).reshape(len(rows), k)


def draw_inputs(
    rows: list[DraftRow], k: int, sample: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per request: its softmax temperature ([R] fp32, softmax_temperatures), whether it is greedy ([R] bool) and,
    when sampling, every uniform of its block ([R, k] fp64), uploaded without a host sync."""
    temps = upload(softmax_temperatures([r.temperature for r in rows]), torch.float32, device)
    greedy = upload([r.greedy for r in rows], torch.bool, device)
    u_all = None
    if sample:
        u = draft_uniforms(rows, k)
        u_all = upload_tensor(torch.from_numpy(u), device)
    return temps, greedy, u_all


def sample_block_with(
    base_logits: torch.Tensor,  # [R_pad, k, vocab] fp32
    h: torch.Tensor,  # [R_pad, k, hidden]
    anchors: torch.Tensor,  # [R_pad] int64
    head: MarkovHead | None,
    confidence: ConfidenceHead | None,
    temps: torch.Tensor,  # [R] fp32, softmax_temperatures(): the first R rows are requests, the rest padding
    greedy: torch.Tensor,  # [R] bool
    u_all: torch.Tensor | None,  # [R, k] fp64; None: every draft is the argmax
    probs_out: torch.Tensor | None = None,  # [k, R, vocab] fp32: where draft j's distributions go (then not returned)
) -> BlockDrafts:
    """sample_block on device inputs only: no host value is read, so a CUDA graph can capture it.

    With probs_out, each position's distributions are written there as they are computed (position-major, each
    [R, vocab] slice contiguous), and BlockDrafts.probs is None: the [R, k, vocab] stack and a caller's copy of it are
    two passes over every drafted row's vocabulary that a caller keeping the distributions does not need. Its greedy
    rows hold their softmax at the greedy temperature, not a one-hot: the caller (the pipelined step) verifies them by
    argmax, and what it computes from their distributions it discards."""
    num_reqs, k = temps.shape[0], base_logits.shape[1]
    sample = u_all is not None
    if u_all is None and head is not None and head.w2t is not None and cpu_kernels.supports(base_logits):
        # Greedy on the fast CPU path: every position's correction, argmax and confidence in one C call.
        w = None if confidence is None else confidence.proj.weight.view(-1)
        bias = confidence.proj.bias if confidence is not None else None
        tokens_, conf_ = cpu_kernels.markov_block(
            base_logits[:num_reqs], h[:num_reqs], head.markov_w1.weight, head.w2t, anchors[:num_reqs], w,
            0.0 if bias is None else float(bias),
        )  # fmt: skip
        return BlockDrafts(tokens=tokens_, probs=None, confidence_logits=conf_)
    # On CUDA a sampled position is one kernel (draw_kernel.py): correction, softmax and draw without the logits
    fused = u_all is not None and draw_kernel.enabled(base_logits.device)
    prev = anchors
    tokens, probs, conf = [], [], []
    for j in range(k):
        if head is not None:
            e, correction = head(prev)
        else:
            e, correction = h.new_zeros(h.shape[0], 0), None
        if confidence is not None:
            conf.append(confidence.logit(h[:, j], e)[:num_reqs])
        if fused:
            assert u_all is not None
            x, q = draw_kernel.draw_position(
                base_logits[:num_reqs, j],
                None if correction is None else correction[:num_reqs],
                temps,
                greedy,
                u_all[:, j],
                out=None if probs_out is None else probs_out[j],
                one_hot_greedy=probs_out is None,
            )
            if probs_out is None:
                probs.append(q)
        else:
            logits = base_logits[:, j] if correction is None else base_logits[:, j] + correction  # [R_pad, vocab]
            top = torch.argmax(logits[:num_reqs], dim=-1)
            if u_all is not None:
                if probs_out is None:
                    q = temperature_probs(logits[:num_reqs], temps, greedy, top)
                else:  # greedy rows are verified by argmax (their distribution is read, then discarded): no one-hot
                    q = temperature_probs(logits[:num_reqs], temps, out=probs_out[j])
                # inverse_cdf_rows, not draw(): it reads no host value on any device, so a graph can capture it
                x = torch.where(greedy, top, inverse_cdf_rows(q, u_all[:, j]))
                if probs_out is None:
                    probs.append(q)
            else:
                x = top
        tokens.append(x)
        # padding rows keep their (ignored) anchors; without padding rows, no copy (a kernel a position)
        prev = x if num_reqs == prev.shape[0] else torch.cat([x, prev[num_reqs:]])
    return BlockDrafts(
        tokens=torch.stack(tokens, dim=1),
        probs=torch.stack(probs, dim=1) if sample and probs_out is None else None,
        confidence_logits=torch.stack(conf, dim=1) if confidence is not None else None,
    )
