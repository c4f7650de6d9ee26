"""What the completion and chat endpoints share: the served model's context, request -> SamplingParams (n fanned out
into n engine requests), prompt checks, running a group of requests to the end unless the client leaves, and the
event-stream response that never leaves a request running behind a closed connection."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from dspark.config import SamplingParams
from dspark.engine.input_processor import ContextLengthError, InputProcessor
from dspark.errors import ConfigError
from dspark.outputs import RequestOutput
from dspark.server.async_engine import AsyncEngine, EngineDeadError, EngineError, RequestGroup
from dspark.server.errors import APIError, error_json, from_config_error, invalid
from dspark.server.metrics import ServerMetrics
from dspark.server.process_engine import ProcessEngine
from dspark.server.protocol import PromptTokensDetails, SamplingRequest, Usage

logger = logging.getLogger("dspark.server")

# Request fields passed to SamplingParams under the same name when set (None: SamplingParams' default).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
)


@dataclass
class ServedModel:
    engine: AsyncEngine | ProcessEngine
    metrics: ServerMetrics
    names: list[str]  # names a request may use; the first is the one /v1/models lists first and responses default to

    def model_name(self, requested: str | None) -> str:
        if requested is None:
            return self.names[0]
        if requested not in self.names:
            raise APIError(
                404,
                f"model={requested!r} is not served here; use one of: {', '.join(self.names)}",
                "model",
                "model_not_found",
            )
        return requested

    def processor(self) -> InputProcessor:
        """The engine's input processor; 503 while the engine is starting or after it has stopped."""
        try:
            return self.engine.input_processor
        except EngineDeadError as e:
            raise APIError(503, str(e)) from None

    def check_prompt(self, ids: list[int], param: str) -> None:
        """The engine's own prompt checks (engine/input_processor.py), answered as OpenAI's API answers them."""
        processor = self.processor()
        try:
            processor.check_prompt(ids, param)
        except ContextLengthError as e:
            raise APIError(
                400,
                f"{param} has {e.num_tokens} tokens; this model's maximum context length is {e.max_model_len} tokens, "
                f"so a prompt may have at most {e.max_model_len - 1} (one must be left to generate)",
                param,
                "context_length_exceeded",
            ) from None
        except ConfigError as e:
            raise invalid(param, "", e.allowed) from None

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, param: str, prompt_param: str) -> None:
        """vLLM's answer to a max_tokens that does not fit beside the prompt: a 400 with the numbers (not a cut)."""
        limit = self.processor().max_model_len
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_param}, {max_tokens} in "
                f"the completion). Please reduce the length of the {prompt_param} or {param}.",
                param,
                "context_length_exceeded",
            )

    def encode(self, text: str) -> list[int]:
        return self.processor().encode(text)


def sampling_params(
    body: SamplingRequest, max_tokens: int | None, logprobs: int | None, rename: dict[str, str] | None = None
) -> SamplingParams:
    values: dict[str, Any] = {k: getattr(body, k) for k in SAMPLING_FIELDS if getattr(body, k) is not None}
    try:
        return SamplingParams(**values, max_tokens=max_tokens, logprobs=logprobs, seed=body.seed)
    except ConfigError as e:
        raise from_config_error(e, rename) from None


def fan_out(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n samples of one prompt: with a seed, sample i draws with seed + i (distinct, and reproducible one by one)."""
    if params.seed is None:
        return [params] * n
    try:
        return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]
    except ConfigError:
        raise invalid("seed", params.seed, f"seed + n - 1 must fit in a signed 64-bit integer (n = {n})") from None


def unsupported(body: SamplingRequest) -> None:
    problem = body.unsupported()
    if problem is not None:
        raise invalid(*problem)
    if body.model_extra:
        logger.warning("ignoring unknown request fields: %s", ", ".join(sorted(body.model_extra)))


async def add(
    served: ServedModel, prompts: list[list[int]], params: list[SamplingParams], response_id: str
) -> RequestGroup:
    """Engine requests `<response_id>-<k>`, all added or none."""
    try:
        return await served.engine.add(prompts, params, response_id)
    except ConfigError as e:  # the engine's own checks (a stop token beyond the vocabulary, ...)
        raise from_config_error(e) from None
    except EngineDeadError as e:
        raise APIError(503, str(e)) from None


def usage(prompts: list[list[int]], finals: dict[int, RequestOutput]) -> Usage:
    """Choice k is prompt k // n's sample k % n (n = choices per prompt)."""
    prompt_tokens = sum(len(p) for p in prompts)  # once per prompt, however many samples it has (as OpenAI)
    # From the metrics, not the final outputs' token ids: a stream's final output ("delta") holds its last ones
    completion_tokens = sum(o.metrics.num_generation_tokens for o in finals.values())
    n = max(1, len(finals) // max(1, len(prompts)))
    cached = sum(finals[k].metrics.num_cached_tokens for k in range(0, len(finals), n) if k in finals)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def running_usage(num_prompt_tokens: int, out: RequestOutput) -> dict[str, int]:
    """stream_options.continuous_usage_stats: one choice's usage so far, in every chunk (as vLLM)."""
    done = out.metrics.num_generation_tokens
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": done, "total_tokens": num_prompt_tokens + done}


def release(served: ServedModel, group: RequestGroup) -> None:
    served.engine.release(group)
    for out in group.unread_finals:  # finished before the handler stopped reading: finished, not aborted
        served.metrics.finished(out)


async def collect(served: ServedModel, group: RequestGroup, request: Request) -> dict[int, RequestOutput]:
    """Every request's final output by index. A client that disconnects first aborts them (their blocks are freed)."""
    finals: dict[int, RequestOutput] = {}

    async def consume() -> None:
        async for i, out in group:
            if out.finished:
                finals[i] = out
                served.metrics.finished(out)

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise APIError(499, "the client closed the connection")  # nobody reads this; the requests are aborted
        try:
            work.result()
        except EngineError as e:
            raise APIError(503 if isinstance(e, EngineDeadError) else 500, str(e)) from None
    finally:
        work.cancel()
        gone.cancel()
        release(served, group)
    return finals


async def _disconnected(receive: Receive) -> None:
    # After the body has been read, the server's next message is http.disconnect: the client left (or the response
    # finished, by which time this task has been cancelled).
    while (await receive())["type"] != "http.disconnect":
        pass


def sse(data: Any) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


_encode = msgspec.json.Encoder().encode


def sse_json(data: dict[str, Any]) -> bytes:
    """One event from plain data: a single msgspec encode (compact, UTF-8 as is), no pydantic model on the way. The
    streams' per-token path."""
    return b"data: " + _encode(data) + b"\n\n"


async def events(
    served: ServedModel, group: RequestGroup, chunks: Callable[[RequestGroup], AsyncIterator[str | bytes]]
) -> AsyncGenerator[str | bytes, None]:
    """The event stream of `chunks` over the group, then `data: [DONE]`. An engine failure after the stream has
    started (status 200 already sent) becomes an error event; the group is released however the stream ends."""
    try:
        async for chunk in chunks(group):
            yield chunk
    except EngineError as e:
        yield sse(error_json(APIError(503 if isinstance(e, EngineDeadError) else 500, str(e))))
    finally:
        release(served, group)
    yield sse("[DONE]")


class EventStream(StreamingResponse):
    """An SSE response that always closes its body generator: Starlette cancels the sending task when the client
    leaves, and a generator suspended at a `yield` would otherwise stay open (its requests running) until it is
    garbage-collected."""

    def __init__(self, content: AsyncGenerator[str | bytes, None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._content.aclose()
