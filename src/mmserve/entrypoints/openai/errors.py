"""Errors as OpenAI error bodies: `{"error": {"message", "type", "code", "param"}}`.

Client faults (`mmserve.errors.ClientError` and its family, pydantic's validation errors) are 4xx
with a message meant for the client; anything else, a plain `ValueError` included, is a 500 whose
body says only that and names an error id, logged once with the traceback under the same id.
"""

from __future__ import annotations

import logging
import uuid
from http import HTTPStatus
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mmserve.entrypoints.openai.protocol import UNION_TAG, ErrorInfo, ErrorResponse
from mmserve.errors import ClientError, EngineRequestError
from mmserve.frontend.engine_client.core_client import EngineDeadError

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"; nobody reads it
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class OpenAIError(Exception):
    """An HTTP error with an OpenAI error body; raise it anywhere in a handler."""

    def __init__(self, status: int, message: str, type: str | None = None, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or (INVALID_REQUEST if status < 500 else SERVER_ERROR)
        self.code = code or HTTPStatus(status).phrase.lower().replace(" ", "_")
        self.param = param

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, code=self.code, param=self.param))

    def to_response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)


def to_openai_error(exc: BaseException) -> OpenAIError:
    """The OpenAI error an exception stands for (500 for anything unexpected, logged here)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return _validation_error(list(exc.errors()))
    if isinstance(exc, ValidationError):
        return _validation_error(exc.errors())
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"the engine is not running: {exc}", code="engine_dead")
    if isinstance(exc, ClientError):
        return OpenAIError(exc.status, str(exc), code=exc.code, param=exc.param)
    if isinstance(exc, StarletteHTTPException):
        return OpenAIError(exc.status_code, str(exc.detail))
    if isinstance(exc, ClientDisconnect):
        logger.info("the client closed the connection before its request was read in full")
        return OpenAIError(CLIENT_CLOSED_REQUEST, "client closed request", code="client_closed_request")
    error_id = f"err-{uuid.uuid4().hex[:16]}"
    if isinstance(exc, EngineRequestError):  # the engine's own words on a request it failed
        logger.error("request failed in the engine (%s): %s", error_id, exc)
        return OpenAIError(500, f"{exc} ({error_id})", code="engine_error")
    logger.error("internal error %s while serving a request: %s: %s", error_id, type(exc).__name__, exc,
                 exc_info=exc if not isinstance(exc, RecursionError) else None)
    return OpenAIError(500, f"internal server error {error_id} (details are in the server log)",
                       code="internal_error")


def _validation_error(errors: Sequence[Mapping[str, Any]]) -> OpenAIError:
    """One 400 for a body that is not JSON or does not fit the schema, naming the fields."""
    for err in errors:
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return OpenAIError(400, f"the request body is not valid JSON: {detail}".rstrip(": "),
                               code="invalid_json")
    if not errors:
        return OpenAIError(400, "invalid request body", code="invalid_value")
    params = [field_path(err.get("loc", ())) for err in errors]
    problems = "; ".join(f"{p}: {_error_text(err)}" if p else _error_text(err) for p, err in zip(params, errors))
    return OpenAIError(400, f"invalid request: {problems}", code="invalid_value", param=params[0] or None)


def _error_text(err: Mapping[str, Any]) -> str:
    """Pydantic's message, without its "Value error, " prefix on our validators' messages."""
    if err.get("type") == "value_error" and "error" in (err.get("ctx") or {}):
        return str(err["ctx"]["error"])
    return str(err.get("msg", "invalid value"))


def field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """`("body", "messages", 0, "content")` -> `"messages[0].content"` (union tags dropped)."""
    path = ""
    for i, part in enumerate(loc):
        if i == 0 and part == "body":
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif not str(part).startswith(UNION_TAG):
            path += f".{part}" if path else str(part)
    return path


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    return to_openai_error(exc).to_response()


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app raises an OpenAI error body with the right status."""
    for exc_class in (OpenAIError, RequestValidationError, ValidationError, StarletteHTTPException,
                      EngineDeadError, ClientError):
        app.add_exception_handler(exc_class, _handle)
    app.add_middleware(CatchAllMiddleware)


class CatchAllMiddleware:
    """Any other exception becomes its OpenAI error response here (a 500 logged in one line),
    before Starlette's outermost handler would log it again and re-raise it to the server."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            error = to_openai_error(exc)
            if not started:
                await error.to_response()(scope, receive, send)
