"""InputProcessor: a prompt and its SamplingParams become an EngineCoreRequest. Tokenization and every check of a
request's inputs live here, shared by LLM and the server, so a bad prompt gets the same answer wherever it comes
from: an error that names the field, the value and what is allowed."""

from __future__ import annotations

import random
import time
from typing import Any

from dspark.config import SamplingParams
from dspark.engine.messages import EngineCoreInfo, EngineCoreRequest
from dspark.errors import ConfigError


class ContextLengthError(ConfigError):
    """A prompt that leaves no room to generate within max_model_len."""

    def __init__(self, field: str, num_tokens: int, max_model_len: int) -> None:
        super().__init__(
            field,
            f"<{num_tokens} tokens>",
            f"at most max_model_len - 1 = {max_model_len - 1} tokens, so that one can be generated",
        )
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len


class InputProcessor:
    def __init__(self, tokenizer: Any, info: EngineCoreInfo, seed: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        self.eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else info.eos_token_id
        self._rng = random.Random(seed)  # seeds of requests that bring none
        # A fast tokenizer's Rust backend directly: transformers' encode() wraps it in ~60 us of Python a prompt. Used
        # only where it gives transformers' ids on a probe with special tokens and odd spacing.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        probe = "  Hello <|im_start|>world\n\n 12345 héllo"
        if self._backend is not None and self._backend.encode(probe, add_special_tokens=True).ids != list(
            tokenizer.encode(probe, add_special_tokens=True)
        ):
            self._backend = None

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=True).ids
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def check_prompt(self, ids: list[int], field: str = "prompt") -> None:
        """A prompt the engine can run: not empty, and shorter than max_model_len (one token must be generated)."""
        if not ids:
            raise ConfigError(field, "", "must not be empty")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(field, len(ids), self.max_model_len)

    def process(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> tuple[EngineCoreRequest, str | None]:
        """The core's request and the prompt's text (None for token ids)."""
        # The request's own copy: a continued step does not check again what its requests passed when the chain began,
        # so a caller's later change to a shared SamplingParams must not reach it.
        params = params.clone() if params is not None else SamplingParams()
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.encode(prompt)
        else:
            text, ids = None, list(prompt)
            bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ConfigError("prompt_token_ids", bad, f"token ids must be integers in [0, {self.vocab_size})")
        if not ids:
            raise ConfigError("prompt", prompt, "must not be empty")
        bad_stop = next((t for t in params.stop_token_ids or [] if t >= self.vocab_size), None)
        if bad_stop is not None:
            raise ConfigError("stop_token_ids", bad_stop, f"token ids must be in [0, {self.vocab_size})")
        self.check_prompt(ids)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return EngineCoreRequest(request_id, ids, params, seed, self.eos_token_id, time.monotonic()), text
