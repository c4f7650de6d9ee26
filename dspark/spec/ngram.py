"""N-gram (prompt lookup) drafting: speculation for any model with nothing to train.

If the request's last n tokens appeared earlier in its prompt or output, propose the tokens that followed that
earlier occurrence. Longer matches are tried first (max_n down to min_n); among occurrences of the same n-gram the
most recent wins (it is the likeliest to be continued the same way). The drafter has no probabilities, so its
drafts are verified strictly (spec/verify.py), and no state: nothing to roll back when drafts are rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.engine.request import Request
from dspark.spec.drafter import Proposal


@dataclass(frozen=True)
class NgramDrafter:
    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")

    def propose(self, tokens: Sequence[int], num_tokens: int) -> list[int]:
        """Up to num_tokens drafts continuing `tokens` (prompt + output so far); [] when nothing matches."""
        return self.match(tokens, num_tokens)[0]

    def match(self, tokens: Sequence[int], num_tokens: int) -> tuple[list[int], int]:
        """The drafts and the length n of the n-gram they continue (0: no match)."""
        length = len(tokens)
        if num_tokens <= 0:
            return [], 0
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = list(tokens[length - n :])
            # The occurrence must end before the tail starts, so at least one token follows it.
            for start in range(length - n - 1, -1, -1):
                if tokens[start] == tail[0] and list(tokens[start : start + n]) == tail:
                    follow = start + n
                    return list(tokens[follow : min(follow + num_tokens, length)]), n
        return [], 0


class NgramProposer:
    """The Drafter interface over NgramDrafter: host-only, no distribution, no confidence head, nothing to roll back."""

    method = "ngram"
    num_lookahead_tokens = 0
    tap_layers: tuple[int, ...] = ()

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.max_num_tokens = num_tokens
        self.ngram = NgramDrafter(min_n, max_n)

    def extend_context(self, taps: torch.Tensor | None, positions: torch.Tensor, slots: torch.Tensor) -> None:
        pass  # its context is the request's own tokens

    def propose(self, requests: list[Request]) -> Proposal:
        """Drafts, with the match length as each request's stratum: longer matches are continued more reliably,
        which the engine's online acceptance rates per stratum and position learn (the confidences of a drafter
        without a head)."""
        matches = [self.ngram.match(r.all_token_ids, self.max_num_tokens) for r in requests]
        return Proposal([m[0] for m in matches], strata=[m[1] for m in matches])

    @property
    def num_strata(self) -> int:
        return self.ngram.max_n + 1
