"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with the right HTTP status.

Every way a request can be wrong ends here as a 4xx that names the parameter, its value and what is allowed: our own
checks (APIError), dspark's ConfigError (from SamplingParams or the engine), pydantic's validation errors, and
Starlette's routing errors (404 path, 405 method). Anything else is a fault of ours: logged with its traceback and
answered as a bare 500, never as a dropped connection.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.errors import ConfigError, shown
from dspark.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("dspark.server")

# OpenAI's error types by status
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def invalid(param: str, value: object, allowed: str, code: str | None = None) -> APIError:
    """A 400 worded as ConfigError words its message: `param=value is invalid: allowed`."""
    return APIError(400, f"{param}={shown(value)} is invalid: {allowed}", param, code)


def from_config_error(e: ConfigError, rename: dict[str, str] | None = None) -> APIError:
    """A 400 from dspark's ConfigError; `rename` maps SamplingParams' field names to the request's where they differ
    (max_completion_tokens sets max_tokens, top_logprobs sets logprobs)."""
    field = (rename or {}).get(e.field, e.field)
    return invalid(field, e.value, e.allowed)


def from_validation_error(e: ValidationError) -> APIError:
    """A 400 for the first problem pydantic found: its location as the parameter (`messages.0.content`)."""
    err = e.errors(include_url=False)[0]
    param = ".".join(str(p) for p in err["loc"]) or "body"
    if err["type"] == "missing":
        return APIError(400, f"{param} is required", param)
    message = err["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
    message = message.replace("List should have", "must have").replace(" after validation", "")
    return invalid(param, err.get("input"), message)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code))
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def error_json(e: APIError) -> dict[str, Any]:
    """The body of an error sent inside an event stream that has already started (its status was 200)."""
    kind = _TYPES.get(e.status, "internal_server_error")
    return ErrorResponse(error=ErrorInfo(message=e.message, type=kind, param=e.param, code=e.code)).model_dump()


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {e.detail}"
        return error_response(e.status_code, message, code="not_found" if e.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        # Starlette re-raises after this answer, so the server logs the traceback; this line says which request.
        logger.error("internal error answering %s %s: %s: %s", request.method, request.url.path, type(e).__name__, e)
        return error_response(500, f"internal server error ({type(e).__name__}); the server log has the details")
