"""The engine's per-token logprobs ({token id: Logprob(logprob, rank, decoded_token)}, the sampled token first, then
the top N) in OpenAI's two response shapes."""

from __future__ import annotations

from typing import Any

from dspark.outputs import Logprob
from dspark.server.protocol import CompletionLogprobs, TokenLogprob, TopLogprob


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int, text_offset: int
) -> tuple[CompletionLogprobs, int]:
    """The legacy completions shape: per token its text, logprob, and a {text: logprob} dict of the top `num_top`
    plus the sampled token (so up to num_top + 1 entries, as OpenAI documents). Returns the offset after the last
    token too, for the next chunk of a stream."""
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries, strict=True):
        sampled = entry[token_id]
        text = _text(sampled)
        out.tokens.append(text)
        out.token_logprobs.append(sampled.logprob)
        top = {_text(lp): lp.logprob for lp in _top(entry, num_top)}
        top.setdefault(text, sampled.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out, text_offset


def prompt_part(
    prompt_ids: list[int], entries: list[dict[int, Logprob] | None] | None, first_text: str, num_top: int | None
) -> tuple[CompletionLogprobs, int]:
    """An echoed prompt in the legacy completions shape: its first token has no logprob (null, as OpenAI's and vLLM's),
    the others their logprob given the tokens before. Returns the text offset after it too."""
    out = CompletionLogprobs(tokens=[first_text], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
    if num_top is None or entries is None or len(prompt_ids) < 2:
        return out, len(first_text)
    rest, offset = completion_logprobs(prompt_ids[1:], entries[1:], num_top, len(first_text))  # type: ignore[arg-type]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(out, field).extend(getattr(rest, field))
    return out, offset


def vllm_prompt_logprobs(entries: list[dict[int, Logprob] | None]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs field: None first, then {token id: {logprob, rank, decoded_token}} per prompt token."""
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in entries
    ]


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int) -> list[TokenLogprob]:
    """The chat shape: per token its text, logprob, UTF-8 bytes, and exactly the top `num_top` alternatives."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        sampled = entry[token_id]
        top = [TopLogprob(token=_text(lp), logprob=lp.logprob, bytes=_bytes(lp)) for lp in _top(entry, num_top)]
        content.append(
            TokenLogprob(token=_text(sampled), logprob=sampled.logprob, bytes=_bytes(sampled), top_logprobs=top)
        )
    return content


def _top(entry: dict[int, Logprob], num_top: int) -> list[Logprob]:
    # The sampled token keeps its own rank in the entry, so ranks <= num_top are exactly the top alternatives.
    return sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)[:num_top]


def _text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def _bytes(lp: Logprob) -> list[int]:
    return list(_text(lp).encode("utf-8"))
