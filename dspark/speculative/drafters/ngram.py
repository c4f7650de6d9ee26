"""N-gram (prompt lookup) drafting: speculation for any model with nothing to train.

If the request's last n tokens appeared earlier in its prompt or output, propose the tokens that followed that
earlier occurrence. Longer matches are tried first (max_n down to min_n); among occurrences of the same n-gram the
most recent wins (it is the likeliest to be continued the same way). The drafter has no probabilities, so its
drafts are verified strictly (sample/rejection.py), and no state: nothing to roll back when drafts are rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.core.request import Request
from dspark.speculative.drafters.base import Proposal


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


class NgramIndex:
    """NgramDrafter.match for one growing sequence, in O(max_n) per call: for every n-gram that has a token after it,
    the most recent start, updated as tokens are appended (a sequence only ever grows: rejected drafts are never
    appended). A full scan costs O(length * n) Python steps per request and step, which at a few hundred requests
    costs more than the target pass it is meant to save."""

    def __init__(self, ngram: NgramDrafter) -> None:
        self.ngram = ngram
        self.length = 0  # tokens indexed so far
        self.last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(ngram.min_n, ngram.max_n + 1)}

    def match(self, tokens: Sequence[int], num_tokens: int) -> tuple[list[int], int]:
        length = len(tokens)
        if length < self.length:
            raise ValueError(f"the sequence shrank from {self.length} to {length} tokens; an index only grows")
        for n, table in self.last.items():
            # Starts that gain a follower: s + n <= length - 1, not yet indexed (s + n > self.length - 1).
            for start in range(max(0, self.length - n), length - n):
                table[tuple(tokens[start : start + n])] = start
        self.length = length
        if num_tokens <= 0:
            return [], 0
        for n in range(min(self.ngram.max_n, length - 1), self.ngram.min_n - 1, -1):
            start = self.last[n].get(tuple(tokens[length - n :]))
            if start is not None:
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
        self._index: dict[str, NgramIndex] = {}  # request id -> its n-gram index

    def extend_context(self, taps: torch.Tensor | None, positions: torch.Tensor, slots: torch.Tensor) -> None:
        pass  # its context is the request's own tokens

    def propose(self, requests: list[Request]) -> Proposal:
        """Drafts, with the match length as each request's stratum: longer matches are continued more reliably,
        which the engine's online acceptance rates per stratum and position learn (the confidences of a drafter
        without a head)."""
        matches = []
        for r in requests:
            index = self._index.get(r.request_id)
            if index is None:
                index = self._index[r.request_id] = NgramIndex(self.ngram)
            matches.append(index.match(r.all_token_ids, self.max_num_tokens))
        return Proposal([m[0] for m in matches], strata=[m[1] for m in matches])

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)

    @property
    def num_strata(self) -> int:
        return self.ngram.max_n + 1
