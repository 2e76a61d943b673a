"""The one place that turns exceptions into OpenAI error JSON.

Every error the server returns has the shape
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``, in the words of the
vocabulary the gateway uses too (`openai_protocol.errors`); handlers raise :class:`APIError`
(or let a pydantic ``ValidationError`` escape) and never build error bodies themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backend_engine.async_engine import EngineError, EngineStopped
from openai_protocol import errors as vocabulary
from openai_protocol.errors import ErrorKind
from openai_protocol.field_rules import FieldError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with a status code and the fields of an OpenAI error body."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.error_type = error_type or vocabulary.type_for(status_code)

    @classmethod
    def of(cls, kind: ErrorKind, message: str, *, param: str | None = None) -> APIError:
        """An error of one of the vocabulary's kinds (its status, type and code)."""
        return cls(
            message, status_code=kind.status, param=param, code=kind.code, error_type=kind.type
        )

    def body(self) -> dict[str, Any]:
        return vocabulary.error_body(self.message, self.error_type, self.code, self.param)


def invalid_request(message: str, *, param: str | None = None) -> APIError:
    return APIError.of(vocabulary.INVALID_REQUEST, message, param=param)


def context_length_exceeded(message: str, *, param: str) -> APIError:
    return APIError.of(vocabulary.CONTEXT_LENGTH_EXCEEDED, message, param=param)


def model_not_found(model: str) -> APIError:
    return APIError.of(
        vocabulary.MODEL_NOT_FOUND, vocabulary.model_not_found_message(model), param="model"
    )


def body_too_large(limit_bytes: int) -> APIError:
    return APIError.of(
        vocabulary.REQUEST_TOO_LARGE,
        f"Request body is larger than the limit of {limit_bytes} bytes",
    )


def unsupported_encoding(encoding: str) -> APIError:
    return APIError.of(
        vocabulary.UNSUPPORTED_CONTENT_ENCODING,
        f"Content-Encoding {encoding[:40]!r} is not supported: send the body uncompressed.",
    )


def from_field_error(exc: FieldError) -> APIError:
    return APIError(exc.message, param=exc.param, code=exc.code)  # a 400 of the field's code


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problems pydantic found, with the offending field as ``param``."""
    errors = exc.errors(include_url=False)
    if errors and errors[0]["type"] == "json_invalid":
        return APIError.of(
            vocabulary.INVALID_JSON, f"Request body is not valid JSON: {errors[0]['msg']}"
        )
    parts = []
    for error in errors[:3]:
        where = ".".join(str(p) for p in error["loc"])
        parts.append(f"{where}: {error['msg']}" if where else error["msg"])
    param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None
    return invalid_request("; ".join(parts) or "Invalid request", param=param)


def engine_failure(exc: EngineError) -> APIError:
    """This request failed inside the engine (the requests batched with it went on)."""
    return APIError.of(vocabulary.ENGINE_ERROR, str(exc))


def engine_not_ready() -> APIError:
    return APIError.of(
        vocabulary.ENGINE_NOT_READY, "The engine is still loading its model; try again shortly."
    )


def engine_draining() -> APIError:
    return APIError.of(
        vocabulary.ENGINE_DRAINING, "The engine is shutting down and takes no new requests."
    )


def error_response(error: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=headers)


def to_api_error(exc: BaseException) -> APIError:
    """Any exception as the APIError a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, EngineStopped):
        return APIError.of(
            vocabulary.ENGINE_DRAINING, "The engine shut down before this request finished."
        )
    if isinstance(exc, EngineError):
        return engine_failure(exc)
    if isinstance(exc, HTTPException):
        message = {404: "Not found", 405: "Method not allowed"}.get(exc.status_code, exc.detail)
        return APIError.of(vocabulary.http_error_kind(exc.status_code), str(message))
    return APIError.of(vocabulary.INTERNAL_ERROR, "Internal server error")


async def _handle_api_error(request: Request, exc: Exception) -> Response:
    return error_response(to_api_error(exc))


async def _handle_http_exception(request: Request, exc: Exception) -> Response:
    headers = exc.headers if isinstance(exc, HTTPException) else None
    return error_response(to_api_error(exc), headers=headers)


async def _handle_unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error serving %s %s", request.method, request.url.path)
    return error_response(to_api_error(exc))


EXCEPTION_HANDLERS = {
    APIError: _handle_api_error,
    ValidationError: _handle_api_error,
    EngineError: _handle_api_error,  # one request failed (the engine logged why); a 500
    HTTPException: _handle_http_exception,
    Exception: _handle_unexpected,
}
