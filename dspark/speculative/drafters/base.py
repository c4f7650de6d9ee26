"""The drafter interface: what the model runner asks of any drafter, and what a drafter hands back.

After each step the runner shows the drafter the target's tapped hidden states of the tokens that stayed (prefill
chunks and accepted drafts: `extend_context`), then asks it for the next drafts of the requests that go on decoding
(`propose`). Rejected drafts are never shown to `extend_context`, so a drafter's context holds exactly the accepted
history and rolling back costs nothing: positions past it are simply overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from dspark.config import SpeculativeConfig
from dspark.core.request import Request
from dspark.utils.transfer import Download

if TYPE_CHECKING:
    from dspark.attention.base import AttentionBackend
    from dspark.models.llama import CausalLM
    from dspark.speculative.drafters.dspark.model import DSparkModel


@dataclass
class Proposal:
    """Drafts for a batch of requests, in the order they were asked for."""

    # per request, up to max_num_tokens; or their copy to the host, still in flight (read through token_ids), so that
    # the host can prepare the next step while the drafting pass runs on the device
    tokens: list[list[int]] | Download
    # [num_reqs, max_num_tokens, vocab] fp32: the distribution each draft was sampled from; None for drafters
    # without one (their drafts are verified strictly).
    probs: torch.Tensor | None = None
    # [num_reqs, max_num_tokens] calibrated confidences in [0, 1] (on the device): the chance each draft survives given
    # that the drafts before it did; None for drafters without a confidence head.
    confidences: torch.Tensor | None = None
    # Drafters without confidences may sort requests into strata (n-gram: the match length) whose acceptance the
    # engine learns online; None: one stratum.
    strata: list[int] | None = None

    @property
    def on_host(self) -> bool:
        """Whether the drafts are on the host already (reading token_ids will not wait)."""
        return not isinstance(self.tokens, Download)

    @property
    def token_ids(self) -> list[list[int]]:
        """The drafts; the first read waits for their copy to the host."""
        if isinstance(self.tokens, Download):
            self.tokens = self.tokens.wait()[0].tolist()
        return self.tokens


class Drafter(Protocol):
    method: str
    max_num_tokens: int  # K: the most drafts it proposes per request and step
    num_lookahead_tokens: int  # KV slots past a request's last token it writes while drafting
    tap_layers: tuple[int, ...]  # target decoder layers whose raw outputs it reads (sorted; empty: none)

    def extend_context(
        self,
        taps: torch.Tensor | None,  # [n, len(tap_layers) * hidden]: the target's tapped outputs of tokens that stay
        positions: torch.Tensor,  # [n] int64
        slots: torch.Tensor,  # [n] int64: their KV slots (the drafter's cache shares the target's block tables)
    ) -> None:
        """Called after every step that tapped layers (drafters with an empty tap_layers are never called)."""
        ...

    def propose(self, requests: list[Request]) -> Proposal:
        """Drafts continuing each request's tokens; each request's target KV covers all but its last token."""
        ...

    # Optional: `release(request_id)`, called when a request finishes, for drafters that keep per-request state.


def make_drafter(
    spec: SpeculativeConfig,
    num_tokens: int,
    target: CausalLM,
    dspark_model: DSparkModel | None,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    backend: AttentionBackend | None = None,  # the DSpark drafter's attention; None: the torch reference
) -> Drafter:
    """The drafter of a speculative config; the DSpark weights were loaded (and checked) by the engine."""
    from dspark.speculative.drafters.dspark.drafter import DSparkDrafter
    from dspark.speculative.drafters.ngram import NgramProposer

    if spec.method == "ngram":
        return NgramProposer(num_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    assert dspark_model is not None
    sample = spec.draft_sample_method == "probabilistic"
    return DSparkDrafter(dspark_model, target, num_tokens, sample, num_blocks, block_size, device, dtype, backend)
