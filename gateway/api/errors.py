"""The one place that turns exceptions into OpenAI's error JSON.

Handlers raise `ApiError` (usually from a policy's `Rejection`). Redis and the database
failing to answer (redis-py's ``RedisError``, SQLAlchemy's ``OperationalError``) become a 503
``service_unavailable`` with ``Retry-After``, whichever handler they escape; anything else
becomes a 500 with a generic message, so internal details never reach clients.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from redis.exceptions import RedisError
from sqlalchemy.exc import OperationalError
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


RETRY_AFTER_S = 1  # a Redis or database outage: clients come back after this many seconds


def state_unavailable(what: str) -> ApiError:
    """The 503 for "a store the gateway needs did not answer in time" (``what``: Redis, the
    database): a clean refusal a client may retry, never a 500 and never a hang."""
    return ApiError(
        Rejection(
            503,
            "service_unavailable",
            "server_error",
            f"The gateway cannot reach {what} right now; please retry.",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    )


def change_not_announced() -> ApiError:
    """The 503 for an admin change saved in the database whose announcement to the other
    replicas (the auth epoch, in Redis) failed: retrying the request announces it."""
    return ApiError(
        Rejection(
            503,
            "service_unavailable",
            "server_error",
            "The change is saved, but the gateway could not announce it to its replicas "
            "(Redis did not answer): retry the request to announce it; until then other "
            "replicas apply it within auth_cache_ttl_s.",
            headers={"Retry-After": str(RETRY_AFTER_S)},
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
    if isinstance(exc, RedisError):
        return state_unavailable("its rate-limit and budget store").rejection
    if isinstance(exc, OperationalError):
        return state_unavailable("its database").rejection
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
    if isinstance(exc, RedisError | OperationalError):
        logger.warning("%s on %s: %s", type(exc).__name__, request.url.path, exc)
    elif not isinstance(exc, ApiError | HTTPException):
        logger.error("unhandled %s on %s", type(exc).__name__, request.url.path, exc_info=exc)
    return error_response(to_rejection(exc))


EXCEPTION_HANDLERS = {
    ApiError: handle_exception,
    HTTPException: handle_exception,
    RedisError: handle_exception,
    OperationalError: handle_exception,
}
