"""The FastAPI app: routes, API-key check, and the reading of request bodies.

Bodies are read and parsed here rather than by FastAPI, so that each way a body can be wrong gets its own answer:
413 past the size limit (from Content-Length, and again while reading, for a body that lies about its length or has
none), 400 for bytes that are not UTF-8, for text that is not JSON (or nested too deeply, or with an integer too long
to convert), for JSON that is not an object, for lone surrogates anywhere in it, and for fields of the wrong type
(protocol.py). /v1/* needs the API key when one is set; /health, /version and /metrics stay open,
as in vLLM, for load balancers and scrapers.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from dspark import __version__
from dspark.engine.llm_engine import LLMEngine
from dspark.errors import ConfigError
from dspark.server.async_engine import AsyncEngine, EngineDeadError
from dspark.server.chat import create_chat_completion
from dspark.server.completions import create_completion
from dspark.server.errors import APIError, error_response, from_validation_error, install_handlers, invalid
from dspark.server.metrics import CONTENT_TYPE, FrontPeers, ServerMetrics
from dspark.server.process_engine import ProcessEngine
from dspark.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from dspark.server.serving import ServedModel

MAX_BODY_BYTES = 16 << 20
logger = logging.getLogger("dspark.server")

Body = TypeVar("Body", bound=BaseModel)


def build_app(
    engine: LLMEngine | ProcessEngine,
    served_model_names: list[str],
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    on_start_failure: Callable[[], None] | None = None,
) -> FastAPI:
    """An app serving `engine` under `served_model_names` (the first is the default): an LLMEngine in this process
    (driven by a thread) or a ProcessEngine (its core in another process). The engine starts with the app's lifespan
    and stops with it; the app owns the engine from then on. on_start_failure: called if a ProcessEngine's core fails
    to start (`dspark serve` then exits)."""
    if not served_model_names:
        raise ConfigError("served_model_name", served_model_names, "at least one name")
    async_engine = engine if isinstance(engine, ProcessEngine) else AsyncEngine(engine)
    slot = async_engine.slot if isinstance(async_engine, ProcessEngine) else None
    peers = None if slot is None or slot.count == 1 else FrontPeers(slot.stats_dir, slot.index, slot.count)
    server_metrics = ServerMetrics(async_engine, peers)
    served = ServedModel(async_engine, server_metrics, list(dict.fromkeys(served_model_names)))

    async def watch_start() -> None:
        try:
            await async_engine.wait_ready()
            if peers is not None:
                peers.mark_ready()
        except EngineDeadError:  # the core could not start (the log says why): a server that can serve nothing
            if on_start_failure is not None:
                on_start_failure()
        except OSError as e:  # no readiness mark: every API server's /health would answer 503 for ever
            logger.critical("cannot mark this API server ready: %s", e)
            if on_start_failure is not None:
                on_start_failure()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        watcher = asyncio.ensure_future(watch_start()) if isinstance(async_engine, ProcessEngine) else None
        publisher = asyncio.ensure_future(server_metrics.publish_forever()) if peers is not None else None
        yield
        for task in (watcher, publisher):
            if task is not None:
                task.cancel()
        await async_engine.shutdown()

    app = FastAPI(title="dspark", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    install_handlers(app)

    async def body_of(request: Request, model: type[Body]) -> Body:
        try:
            return model.model_validate(await _read_json(request, max_body_bytes))
        except ValidationError as e:
            raise from_validation_error(e) from None

    @app.get("/health")
    async def health() -> Response:
        if async_engine.starting:
            return error_response(503, "the engine is starting (loading the model)")
        if not async_engine.alive:
            return error_response(503, "the engine is not running; the server log says why")
        if peers is not None and not peers.all_ready():
            ready = peers.num_ready()
            return error_response(503, f"the engine is starting ({ready} of {peers.count} API servers ready)")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.render(), media_type=CONTENT_TYPE)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_key_check(api_key))])

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        max_model_len = served.processor().max_model_len  # 503 while the engine is starting
        cards = [
            ModelCard(id=name, created=created, root=async_engine.model, max_model_len=max_model_len)
            for name in served.names
        ]
        return ModelList(data=cards).model_dump()

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(served, await body_of(request, CompletionRequest), request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(served, await body_of(request, ChatCompletionRequest), request)

    app.include_router(v1)
    return app


def _key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    expected = api_key.encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(
                401, "missing API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        # NOTE: constant time, so the answer's timing says nothing about how much of a guessed key was right.
        if not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(401, "invalid API key", code="invalid_api_key")

    return check


async def _read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None:
        # isascii too: str.isdigit() holds for "²", which int() refuses.
        if not (length.isascii() and length.isdigit()):
            raise APIError(400, f"Content-Length {length!r} is not a byte count", code="invalid_content_length")
        if int(length) > limit:
            raise _too_large(f"Content-Length is {length}", limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(f"more than {limit} bytes were sent", limit)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(
            400, f"the request body is not valid UTF-8 (byte {e.start}: {e.reason})", code="invalid_body"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(
            400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", code="invalid_json"
        ) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits())
        raise APIError(400, f"the request body has a number too long to read ({e})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    _check_unicode(data)
    return data


def _check_unicode(data: Any) -> None:
    """JSON's escapes can spell lone surrogates ("\\ud800"), which are not text: the tokenizer, pydantic (in a key)
    and the encoder of an answer that quotes them all fail on them. Refused here, wherever they are, naming where.
    Iterative, since the body may be nested as deeply as the JSON parser allows."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                raise invalid(path, value, "must be valid Unicode (no lone surrogates)")
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", v) for i, v in reversed(list(enumerate(value))))
        elif isinstance(value, dict):
            for key in value:
                if not _is_text(key):  # named with \uXXXX escapes: the answer's JSON could not carry the key itself
                    name = f"{path}.{key.encode('utf-8', 'backslashreplace').decode()}".lstrip(".")
                    raise invalid(name, key, "a key must be valid Unicode (no lone surrogates)")
            stack.extend((f"{path}.{k}".lstrip("."), v) for k, v in reversed(value.items()))


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _too_large(what: str, limit: int) -> APIError:
    return APIError(
        413, f"the request body is too large ({what}); the limit is {limit} bytes", code="request_too_large"
    )
