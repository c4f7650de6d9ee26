"""Incremental detokenisation for streaming: text grows token by token and never splits a multi-byte character.

Byte-level BPE tokens can end in the middle of a UTF-8 character, and a token's text can depend on its neighbours
(leading spaces). So we decode a short window ending at the new tokens and emit what it adds over the window without
them; while the window ends in U+FFFD (an incomplete character) we wait for the next token.
"""

from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 6  # prompt tokens used as left context for the first output tokens


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        # The Rust tokenizer directly: transformers' decode wraps it in ~2 us of Python per call, twice per token and
        # request. Equal text only without its clean-up of tokenization spaces, so only then.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._fast = (
            backend if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True) else None
        )

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return delta

    def add_all(self, token_ids: list[int]) -> str:
        """Append many tokens at once, for text nobody reads before the request ends: a few decodes instead of two per
        token. Like add, it leaves out trailing tokens that end inside a character (whole tokens, with their other
        bytes: a token " \xc3" holds back its space too)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        end = len(self.ids)
        full = self._decode(self.ids[self.prefix_offset : end])
        while full.endswith("\ufffd") and end > self.read_offset:
            end -= 1
            full = self._decode(self.ids[self.prefix_offset : end])
        if end <= self.read_offset or len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, end
        return full[len(prefix) :]
