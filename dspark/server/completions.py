"""POST /v1/completions: one or more prompts (text or token ids), n samples each, whole or streamed.

`echo` puts the prompt before each choice's text and, with `logprobs`, its tokens' logprobs before the completion's
(the first prompt token's null), as OpenAI's legacy API and vLLM do: what lm-evaluation-harness's loglikelihood tasks
read. vLLM's `prompt_logprobs` adds each choice's prompt_logprobs field."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from dspark.errors import ConfigError
from dspark.outputs import RequestOutput
from dspark.server.async_engine import RequestGroup
from dspark.server.errors import from_config_error, invalid
from dspark.server.logprobs import completion_logprobs, prompt_part, vllm_prompt_logprobs
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
    # echo with logprobs needs the prompt's logprobs, as many alternatives as the completion's
    prompt_logprobs = body.prompt_logprobs if body.prompt_logprobs is not None else body.logprobs if body.echo else None
    if prompt_logprobs is not None:
        try:
            params = dataclasses.replace(params, prompt_logprobs=prompt_logprobs)
        except ConfigError as e:
            field = "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs"
            raise from_config_error(e, {"prompt_logprobs": field}) from None
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
    num_samples = len(finals) // len(prompts)
    choices = [_choice(served, body, i, finals[i], prompts[i // num_samples]) for i in range(len(finals))]
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


def _echo(
    served: ServedModel, body: CompletionRequest, out: RequestOutput, prompt: list[int]
) -> tuple[str, CompletionLogprobs | None, int]:
    """The echoed prompt: its text, its logprobs (when asked for) and the text offset after it."""
    tokenizer = served.processor().tokenizer
    text = out.prompt if out.prompt is not None else tokenizer.decode(prompt)
    if body.logprobs is None:
        return text, None, len(text)
    logprobs, _ = prompt_part(prompt, out.prompt_logprobs, tokenizer.decode(prompt[:1]), body.logprobs)
    return text, logprobs, len(text)  # the completion's offsets count from the text echoed


def _choice(
    served: ServedModel, body: CompletionRequest, index: int, out: RequestOutput, prompt: list[int]
) -> CompletionChoice:
    c = out.outputs[0]
    text, logprobs, offset = _echo(served, body, out, prompt) if body.echo else ("", None, 0)
    if body.logprobs is not None and c.logprobs is not None:
        mine, _ = completion_logprobs(c.token_ids, c.logprobs, body.logprobs, offset)
        logprobs = _joined(logprobs, mine)
    return CompletionChoice(
        index=index,
        text=text + c.text,
        logprobs=logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        prompt_logprobs=_prompt_logprobs(body, out),
    )


def _joined(first: CompletionLogprobs | None, then: CompletionLogprobs) -> CompletionLogprobs:
    if first is None:
        return then
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(first, field).extend(getattr(then, field))
    return first


def _prompt_logprobs(body: CompletionRequest, out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    if body.prompt_logprobs is None or out.prompt_logprobs is None:
        return None
    return vllm_prompt_logprobs(out.prompt_logprobs)


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
    started: set[int] = set()
    async for i, out in group:
        c = out.outputs[0]
        logprobs: CompletionLogprobs | None = None
        text = out.new_text
        first = i not in started and (body.echo or body.prompt_logprobs is not None)  # a first chunk with more
        started.add(i)
        if first and body.echo:  # the prompt goes out with the choice's first chunk
            prompt_text, logprobs, offsets[i] = _echo(served, body, out, prompts[i // num_samples])
            text = prompt_text + text
        if body.logprobs is not None and c.logprobs is not None and out.new_token_ids:
            new = c.logprobs  # a delta output's logprobs: the new tokens' only
            mine, offsets[i] = completion_logprobs(out.new_token_ids, new, body.logprobs, offsets.get(i, 0))
            logprobs = _joined(logprobs, mine)
        if out.finished:
            finals[i] = out
            served.metrics.finished(out)
        if text or out.finished or logprobs is not None or first:
            choice = {
                "index": i,
                "text": text,
                "logprobs": logprobs.model_dump(mode="json") if logprobs is not None else None,
                "finish_reason": c.finish_reason if out.finished else None,
                "stop_reason": c.stop_reason if out.finished else None,
            }
            if first and body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _prompt_logprobs(body, out)
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
