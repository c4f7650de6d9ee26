"""POST /v1/completions: one or more prompts (text or token ids), n samples each, whole or streamed."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from dspark.outputs import RequestOutput
from dspark.server.async_engine import RequestGroup
from dspark.server.errors import invalid
from dspark.server.logprobs import completion_logprobs
from dspark.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from dspark.server.serving import (
    EventStream,
    ServedModel,
    add,
    collect,
    events,
    fan_out,
    running_usage,
    sampling_params,
    sse,
    sse_json,
    unsupported,
    usage,
)


async def create_completion(served: ServedModel, body: CompletionRequest, request: Request) -> Response:
    unsupported(body)
    model = served.model_name(body.model)
    prompts = [_prompt_ids(served, p) for p in body.prompts()]
    params = sampling_params(body, body.max_tokens, body.logprobs)
    for ids in prompts:
        served.check_length(len(ids), body.max_tokens, "max_tokens", "prompt")
    # A stream gets each step's additions only ("delta"); a whole response one output per request, at its end
    # ("final_only"): the engine builds no per-step outputs, and copies no request's whole output every step.
    params = dataclasses.replace(params, output_kind="delta" if body.stream else "final_only")
    samples = fan_out(params, body.n)
    # Engine request k = prompt k // n, sample k % n; it answers as choice k (OpenAI's and vLLM's order).
    response_id = f"cmpl-{uuid.uuid4().hex}"
    group = await add(served, [ids for ids in prompts for _ in samples], samples * len(prompts), response_id)
    created = int(time.time())
    if body.stream:
        return EventStream(
            events(served, group, lambda g: _chunks(served, body, g, prompts, response_id, model, created))
        )
    finals = await collect(served, group, request)
    choices = [_choice(i, finals[i], body.logprobs) for i in range(len(finals))]
    response = CompletionResponse(
        id=response_id, created=created, model=model, choices=choices, usage=usage(prompts, finals)
    )
    return JSONResponse(response.model_dump(mode="json"))


def _prompt_ids(served: ServedModel, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        ids = served.encode(prompt)
    else:
        vocab = served.processor().vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid("prompt", bad, f"token ids must be in [0, {vocab})")
        ids = prompt
    served.check_prompt(ids, "prompt")
    return ids


def _choice(index: int, out: RequestOutput, num_logprobs: int | None) -> CompletionChoice:
    c = out.outputs[0]
    logprobs = None
    if num_logprobs is not None and c.logprobs is not None:
        logprobs, _ = completion_logprobs(c.token_ids, c.logprobs, num_logprobs, 0)
    return CompletionChoice(
        index=index, text=c.text, logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason
    )


async def _chunks(
    served: ServedModel,
    body: CompletionRequest,
    group: RequestGroup,
    prompts: list[list[int]],
    response_id: str,
    model: str,
    created: int,
) -> AsyncIterator[str | bytes]:
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    continuous = options is not None and options.continuous_usage_stats
    head = {"id": response_id, "object": "text_completion", "created": created, "model": model}
    num_samples = len(group.request_ids) // len(prompts)
    offsets: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}
    async for i, out in group:
        c = out.outputs[0]
        logprobs: CompletionLogprobs | None = None
        if body.logprobs is not None and c.logprobs is not None and out.new_token_ids:
            new = c.logprobs  # a delta output's logprobs: the new tokens' only
            logprobs, offsets[i] = completion_logprobs(out.new_token_ids, new, body.logprobs, offsets.get(i, 0))
        if out.finished:
            finals[i] = out
            served.metrics.finished(out)
        if out.new_text or out.finished or logprobs is not None:
            choice = {
                "index": i,
                "text": out.new_text,
                "logprobs": logprobs.model_dump(mode="json") if logprobs is not None else None,
                "finish_reason": c.finish_reason if out.finished else None,
                "stop_reason": c.stop_reason if out.finished else None,
            }
            payload: dict[str, Any] = {**head, "choices": [choice]}
            # OpenAI: usage is null in every chunk but the last, if asked for (continuous: the choice's so far)
            if continuous:
                payload["usage"] = running_usage(len(prompts[i // num_samples]), out)
            elif include_usage:
                payload["usage"] = None
            yield sse_json(payload)
    if include_usage:
        last = CompletionResponse(
            id=response_id, created=created, model=model, choices=[], usage=usage(prompts, finals)
        )
        yield sse(last.model_dump_json())
