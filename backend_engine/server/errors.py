"""The one place that turns exceptions into OpenAI error JSON.

Every error the server returns has the shape
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``; handlers
raise :class:`APIError` (or let a pydantic ``ValidationError`` escape) and never
build error bodies themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backend_engine.async_engine import EngineError
from openai_protocol.field_rules import FieldError

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


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
        self.error_type = error_type or _TYPE_BY_STATUS.get(status_code, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid_request(message: str, *, param: str | None = None) -> APIError:
    return APIError(message, param=param)


def context_length_exceeded(message: str, *, param: str) -> APIError:
    return APIError(message, param=param, code="context_length_exceeded")


def model_not_found(model: str) -> APIError:
    return APIError(
        f"The model {model!r} does not exist",
        status_code=404,
        param="model",
        code="model_not_found",
    )


def body_too_large(limit_bytes: int) -> APIError:
    return APIError(
        f"Request body is larger than the limit of {limit_bytes} bytes",
        status_code=413,
        code="request_too_large",
    )


def unsupported_encoding(encoding: str) -> APIError:
    return APIError(
        f"Content-Encoding {encoding[:40]!r} is not supported: send the body uncompressed.",
        status_code=415,
        code="unsupported_content_encoding",
    )


def from_field_error(exc: FieldError) -> APIError:
    return APIError(exc.message, param=exc.param, code=exc.code)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problems pydantic found, with the offending field as ``param``."""
    errors = exc.errors(include_url=False)
    if errors and errors[0]["type"] == "json_invalid":
        return APIError(f"Request body is not valid JSON: {errors[0]['msg']}")
    parts = []
    for error in errors[:3]:
        where = ".".join(str(p) for p in error["loc"])
        parts.append(f"{where}: {error['msg']}" if where else error["msg"])
    param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None
    return APIError("; ".join(parts) or "Invalid request", param=param)


def engine_failure(exc: EngineError) -> APIError:
    """This request failed inside the engine (the requests batched with it went on)."""
    return APIError(str(exc), status_code=500, code="engine_error", error_type="server_error")


def error_response(error: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=headers)


def to_api_error(exc: BaseException) -> APIError:
    """Any exception as the APIError a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, EngineError):
        return engine_failure(exc)
    if isinstance(exc, HTTPException):
        message = {404: "Not found", 405: "Method not allowed"}.get(exc.status_code, exc.detail)
        return APIError(str(message), status_code=exc.status_code)
    return APIError("Internal server error", status_code=500)


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
