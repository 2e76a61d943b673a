"""The one place that turns exceptions into OpenAI's error JSON.

Handlers raise `ApiError` (usually from a policy's `Rejection`); anything else that escapes
a handler becomes a 500 with a generic message, so internal details never reach clients.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from policies.decision import Rejection

logger = logging.getLogger(__name__)

_HTTP_TYPES = {
    401: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
}


class ApiError(Exception):
    """A refusal to send as an OpenAI error; ``reason`` names it in metrics and usage."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection

    @property
    def reason(self) -> str:
        return self.rejection.code


def invalid_request(
    message: str, param: str | None = None, *, code: str = "invalid_request"
) -> ApiError:
    return ApiError(Rejection(400, code, "invalid_request_error", message, param))


def invalid_api_key() -> ApiError:
    return ApiError(
        Rejection(
            401,
            "invalid_api_key",
            "invalid_request_error",
            "Incorrect API key provided. Pass a valid key as `Authorization: Bearer <key>`.",
        )
    )


def body_too_large(limit: int) -> ApiError:
    return ApiError(
        Rejection(
            413,
            "request_too_large",
            "invalid_request_error",
            f"The request body is larger than the limit of {limit} bytes.",
        )
    )


def unsupported_encoding(encoding: str) -> ApiError:
    return ApiError(
        Rejection(
            415,
            "unsupported_content_encoding",
            "invalid_request_error",
            f"Content-Encoding {encoding[:40]!r} is not supported: send the body uncompressed.",
        )
    )


def upstream_unavailable(model: str) -> ApiError:
    return ApiError(
        Rejection(
            503,
            "upstream_unavailable",
            "server_error",
            f"No engine serving `{model}` could take the request; please retry.",
        )
    )


def error_response(rejection: Rejection, headers: Mapping[str, str] | None = None) -> Response:
    return JSONResponse(
        rejection.error_body(),
        status_code=rejection.status,
        headers={**rejection.headers, **(headers or {})},
    )


def to_rejection(exc: BaseException) -> Rejection:
    if isinstance(exc, ApiError):
        return exc.rejection
    if isinstance(exc, HTTPException):
        return Rejection(
            exc.status_code,
            f"http_{exc.status_code}",
            _HTTP_TYPES.get(exc.status_code, "invalid_request_error"),
            str(exc.detail),
            headers=exc.headers or {},  # a 405's Allow
        )
    return Rejection(500, "internal_error", "server_error", "The gateway failed unexpectedly.")


async def handle_exception(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, ApiError | HTTPException):
        logger.error("unhandled %s on %s", type(exc).__name__, request.url.path, exc_info=exc)
    return error_response(to_rejection(exc))


EXCEPTION_HANDLERS = {ApiError: handle_exception, HTTPException: handle_exception}
