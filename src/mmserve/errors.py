"""The client-error family: exceptions that mean "the request is at fault", raisable from any layer.

This module sits at the bottom of the import graph (it imports nothing from mmserve), so the
engine, the workers, the item path and the HTTP layer can all raise it. The HTTP layer maps a
`ClientError` to a 4xx with the OpenAI error body and anything else to a 500 with one log line
and a request id. Every `ClientError` is also a `ValueError`, so callers that catch (or tests that
expect) `ValueError` keep working.
"""

from __future__ import annotations

CLIENT = "client"  # EngineCoreOutput.error_kind: the request was refused
INTERNAL = "internal"  # EngineCoreOutput.error_kind: the engine failed while serving it


class ClientError(ValueError):
    """The request is at fault; `status` is the HTTP status, `code` the OpenAI error code."""

    status = 400
    code = "invalid_value"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code


class SchemaError(ClientError):
    """A structured-output schema that is malformed, unsupported, too large or unsatisfiable."""


class StopStringsError(ClientError):
    """Stop strings beyond the server's count or length limits."""


class RequestFault(RuntimeError):
    """A step failed in work that belongs to one request (its grammar, its items, its sampling
    settings): the engine fails `request_id` alone and keeps stepping."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_id = request_id


class EngineRequestError(RuntimeError):
    """The engine failed while serving one request (a 500: not the client's fault)."""


def engine_error(message: str, kind: str = CLIENT) -> Exception:
    """The exception an engine error output stands for: a `ClientError` for a refusal, an
    `EngineRequestError` for a failure inside the engine."""
    return EngineRequestError(message) if kind == INTERNAL else ClientError(message)
