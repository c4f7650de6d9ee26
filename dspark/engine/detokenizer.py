"""Incremental detokenisation for streaming: text grows token by token and never splits a multi-byte character.

Byte-level BPE tokens can end in the middle of a UTF-8 character, and a token's text can depend on its neighbours
(leading spaces). So we decode a short window ending at the new tokens and emit what it adds over the window without
them; while the window ends in U+FFFD (an incomplete character) we wait for the next token.
"""

from __future__ import annotations

from typing import Any

try:
    from tokenizers.decoders import ByteLevel, DecodeStream
except ImportError:  # tokenizers < 0.21: the offsets below only
    ByteLevel = DecodeStream = None

CONTEXT_TOKENS = 6  # prompt tokens used as left context for the first output tokens


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        # The Rust tokenizer directly: transformers' decode wraps each call in Python, and it runs twice per token and
        # request. Equal text only without its clean-up of tokenization spaces, so only then.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._fast = (
            backend if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True) else None
        )
        # add() through the Rust tokenizer's own DecodeStream: the same windows, one call per token instead of two
        # decodes and their slicing. Made at the first add(): a request whose text is deferred calls only add_all().
        # Byte-level decoders only (GPT-2 style: SmolLM2, Llama 3, Qwen). Under a ByteFallback decoder
        # (SentencePiece style: Llama 2) a byte run that is not UTF-8 turns bytes already shown into U+FFFD, and the
        # stream raises "Invalid prefix" where the offsets go on.
        self._stream: Any = None
        self._use_offsets = self._fast is None or DecodeStream is None or not isinstance(self._fast.decoder, ByteLevel)

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self.ids.extend(token_ids)
        if not self._use_offsets:
            if self._stream is None:
                self._stream = self._new_stream()
            if self._stream is not None:
                try:
                    text = self._stream.step(self._fast, token_ids[0] if len(token_ids) == 1 else token_ids)
                except Exception:
                    # Not seen with a byte-level decoder; should it come, the offsets (kept in step below) take
                    # over from this token on rather than the request failing.
                    self._stream, self._use_offsets = None, True
                else:
                    if text:  # the offsets follow the stream's windows, for the fallback above
                        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                    return text or ""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return delta

    def _new_stream(self) -> Any:
        """A DecodeStream over the prompt context, or None (and the offsets from now on) where it would not give the
        offsets' text: after a context that decodes to a trailing U+FFFD (it ends inside a character), the stream can
        emit the context's own text."""
        context = self.ids[self.prefix_offset : self.read_offset]
        if self._decode(context).endswith("\ufffd"):
            self._use_offsets = True
            return None
        try:
            return DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)
        except TypeError:  # tokenizers < 0.22 takes no context ids
            self._use_offsets = True
            return None

    def add_all(self, token_ids: list[int]) -> str:
        """Append many tokens at once, for text nobody reads before the request ends: a few decodes instead of two per
        token. Like add, it leaves out trailing tokens that end inside a character (whole tokens, with their other
        bytes: a token " \xc3" holds back its space too). A detokenizer is fed by add() or by add_all(), not both."""
        assert self._stream is None, "add_all() after add(): the stream holds add()'s state"
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
