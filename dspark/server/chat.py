"""POST /v1/chat/completions: the conversation through the model's chat template, n samples, whole or streamed."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from dspark.config import MAX_LOGPROBS
from dspark.outputs import RequestOutput
from dspark.server.async_engine import RequestGroup
from dspark.server.errors import APIError, invalid
from dspark.server.logprobs import chat_logprobs
from dspark.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
)
from dspark.server.serving import (
    EventStream,
    ServedModel,
    add,
    collect,
    events,
    fan_out,
    running_usage,
    sampling_params,
    sse_json,
    unsupported,
    usage,
)


async def create_chat_completion(served: ServedModel, body: ChatCompletionRequest, request: Request) -> Response:
    unsupported(body)
    model = served.model_name(body.model)
    prompt = _apply_template(served, body)
    served.check_prompt(prompt, "messages")
    num_top = None
    if body.logprobs:
        num_top = body.top_logprobs or 0
        if not 0 <= num_top <= MAX_LOGPROBS:
            raise invalid("top_logprobs", num_top, f"must be in [0, {MAX_LOGPROBS}]")
    if body.max_completion_tokens is not None:
        max_tokens, rename = body.max_completion_tokens, {"max_tokens": "max_completion_tokens"}
    else:
        max_tokens, rename = body.max_tokens, {}
    params = sampling_params(body, max_tokens, num_top, {**rename, "logprobs": "top_logprobs"})
    served.check_length(len(prompt), max_tokens, rename.get("max_tokens", "max_tokens"), "messages")
    # A stream gets each step's additions only ("delta"); a whole response one output per request, at its end
    # ("final_only"): the engine builds no per-step outputs, and copies no request's whole output every step.
    params = dataclasses.replace(params, output_kind="delta" if body.stream else "final_only")
    samples = fan_out(params, body.n)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    group = await add(served, [prompt] * body.n, samples, response_id)
    created = int(time.time())
    if body.stream:
        return EventStream(
            events(served, group, lambda g: _chunks(served, body, g, prompt, num_top, response_id, model, created))
        )
    finals = await collect(served, group, request)
    choices = [_choice(i, finals[i], num_top) for i in range(len(finals))]
    response = ChatCompletionResponse(
        id=response_id, created=created, model=model, choices=choices, usage=usage([prompt], finals)
    )
    return JSONResponse(response.model_dump(mode="json"))


def _apply_template(served: ServedModel, body: ChatCompletionRequest) -> list[int]:
    tokenizer = served.engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("model", served.names[0], "has no chat template; use /v1/completions")
    conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        ids: Any = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    except Exception as e:  # the template's own checks (roles out of order, ...) raise jinja2 errors
        raise APIError(400, f"messages: the chat template refused them: {type(e).__name__}: {e}", "messages") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _choice(index: int, out: RequestOutput, num_top: int | None) -> ChatChoice:
    c = out.outputs[0]
    logprobs = None
    if num_top is not None and c.logprobs is not None:
        logprobs = ChatLogprobs(content=chat_logprobs(c.token_ids, c.logprobs, num_top))
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=c.text),
        logprobs=logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )


async def _chunks(
    served: ServedModel,
    body: ChatCompletionRequest,
    group: RequestGroup,
    prompt: list[int],
    num_top: int | None,
    response_id: str,
    model: str,
    created: int,
) -> AsyncIterator[str | bytes]:
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    continuous = options is not None and options.continuous_usage_stats
    head = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(choices: list[dict[str, Any]], usage_now: dict[str, Any] | None = None) -> bytes:
        # OpenAI: usage is null in every chunk but the last, if asked for (continuous: a choice's usage so far)
        payload = {**head, "choices": choices}
        if include_usage or continuous:
            payload["usage"] = usage_now
        return sse_json(payload)

    def choice(i: int, delta: dict[str, str], logprobs: ChatLogprobs | None, out: RequestOutput | None) -> dict:
        c = out.outputs[0] if out is not None and out.finished else None
        return {
            "index": i,
            "delta": delta,  # OpenAI's deltas carry only what they set
            "logprobs": logprobs.model_dump(mode="json") if logprobs is not None else None,
            "finish_reason": c.finish_reason if c is not None else None,
            "stop_reason": c.stop_reason if c is not None else None,
        }

    # OpenAI opens every choice with the assistant's role and empty content.
    yield chunk([choice(i, {"role": "assistant", "content": ""}, None, None) for i in range(body.n)])
    finals: dict[int, RequestOutput] = {}
    async for i, out in group:
        logprobs = None
        if num_top is not None and out.outputs[0].logprobs is not None and out.new_token_ids:
            new = out.outputs[0].logprobs  # a delta output's logprobs: the new tokens' only
            logprobs = ChatLogprobs(content=chat_logprobs(out.new_token_ids, new, num_top))
        if out.finished:
            finals[i] = out
            served.metrics.finished(out)
        if out.new_text or out.finished or logprobs is not None:
            delta = {"content": out.new_text} if out.new_text else {}
            yield chunk([choice(i, delta, logprobs, out)], running_usage(len(prompt), out) if continuous else None)
    if include_usage:
        yield chunk([], usage([prompt], finals).model_dump(mode="json"))
