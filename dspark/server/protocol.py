"""The OpenAI API's request and response bodies, as pydantic models.

Requests are validated strictly (no "1" for 1, no 1.5 for an integer), so that a wrong type is named rather than
silently coerced; ranges are checked where the engine checks them, by SamplingParams. Unknown fields are ignored, as
vLLM does, and logged; fields of OpenAI's API that dspark cannot honour (suffix, logit_bias, tools, a JSON
response_format, best_of > n) are refused with a 400 rather than ignored, since ignoring them would change what the
client gets without telling it.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 128  # OpenAI's limit on choices per request

Prompt = str | list[str] | list[int] | list[list[int]]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's: usage in every chunk (its choice's tokens so far), for clients that count tokens when one chunk carries
    # several (accepted drafts, or steps merged for a slow reader)
    continuous_usage_stats: bool = False


class SamplingRequest(_Request):
    """Fields the two endpoints share: OpenAI's, then vLLM's extras (top_k, min_p, ...) that SamplingParams takes."""

    model: str | None = None  # None: the served model
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("must be a string or a list of strings")

    def unsupported(self) -> tuple[str, Any, str] | None:
        """(field, value, why) of the first field set to something dspark cannot do, else None."""
        if self.logit_bias:
            return "logit_bias", self.logit_bias, "not supported; omit it or send {}"
        return None


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False  # the prompt before the completion, in the text and (with logprobs) in the logprobs
    prompt_logprobs: int | None = None  # vLLM's: each choice's prompt_logprobs, the top N of every prompt token
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            if all(isinstance(p, str) for p in value):
                return value
            if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                return value
            if all(
                isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in value
            ):
                return value
        raise ValueError("must be a string, a non-empty list of strings, a list of token ids or a list of such lists")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: one string, or one list of token ids, per prompt."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def unsupported(self) -> tuple[str, Any, str] | None:
        if self.suffix:
            return "suffix", self.suffix, "not supported (no fill-in-the-middle)"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", self.best_of, f"must equal n ({self.n}): dspark returns every sample it draws"
        return super().unsupported()


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string, a list of text parts or null")
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"only text content parts are supported, not {kind!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError('a text part is {"type": "text", "text": <string>}')
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: until the context is full
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, Any, str] | None:
        if self.tools:
            return "tools", f"<{len(self.tools)} tools>", "not supported (no tool calling)"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", self.tool_choice, "not supported (no tool calling)"
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format", self.response_format, 'only {"type": "text"} is supported'
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", self.top_logprobs, "needs logprobs: true"
        return super().unsupported()


# ---- responses ----------------------------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extra: the stop string or token id that ended the choice
    # vLLM's extra, when prompt_logprobs was asked for: None for the first prompt token, then
    # {token id: {"logprob", "rank", "decoded_token"}} for each
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dspark"
    root: str
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo
