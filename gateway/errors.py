"""The one place that turns exceptions, and engines' errors, into OpenAI's error JSON.

Handlers raise `ApiError` (usually from a policy's `Rejection`). Redis and the database
failing to answer (redis-py's ``RedisError``, SQLAlchemy's ``OperationalError``) become a 503
``service_unavailable`` with ``Retry-After``, whichever handler they escape; anything else
becomes a 500 with a generic message, so internal details never reach clients. Codes, types
and the body's shape are the vocabulary the engine speaks too (`openai_protocol.errors`);
an engine's error answer becomes the gateway's own in `from_engine_answer`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import orjson
from redis.exceptions import RedisError
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from openai_protocol import errors as vocabulary
from policies.decision import Rejection

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """A refusal to send as an OpenAI error; ``reason`` names it in metrics and usage."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection

    @property
    def reason(self) -> str:
        return self.rejection.code


def invalid_request(
    message: str, param: str | None = None, *, code: str = vocabulary.INVALID_REQUEST.code
) -> ApiError:
    return ApiError(Rejection(400, code, vocabulary.INVALID_REQUEST_ERROR, message, param))


def invalid_api_key() -> ApiError:
    return ApiError(
        Rejection.of(
            vocabulary.INVALID_API_KEY,
            "Incorrect API key provided. Pass a valid key as `Authorization: Bearer <key>`.",
        )
    )


def body_too_large(limit: int) -> ApiError:
    return ApiError(
        Rejection.of(
            vocabulary.REQUEST_TOO_LARGE,
            f"The request body is larger than the limit of {limit} bytes.",
        )
    )


def unsupported_encoding(encoding: str) -> ApiError:
    return ApiError(
        Rejection.of(
            vocabulary.UNSUPPORTED_CONTENT_ENCODING,
            f"Content-Encoding {encoding[:40]!r} is not supported: send the body uncompressed.",
        )
    )


def upstream_unavailable(model: str) -> ApiError:
    return ApiError(
        Rejection.of(
            vocabulary.UPSTREAM_UNAVAILABLE,
            f"No engine serving `{model}` could take the request; please retry.",
        )
    )


RETRY_AFTER_S = 1  # a Redis or database outage: clients come back after this many seconds


def state_unavailable(what: str) -> ApiError:
    """The 503 for "a store the gateway needs did not answer in time" (``what``: Redis, the
    database): a clean refusal a client may retry, never a 500 and never a hang."""
    return ApiError(
        Rejection.of(
            vocabulary.SERVICE_UNAVAILABLE,
            f"The gateway cannot reach {what} right now; please retry.",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    )


def usage_records_unavailable() -> ApiError:
    """The 503 for a request whose usage record neither the spill file nor the database
    took (`gateway.storage.usage_writer`): no answer goes out without its record."""
    return ApiError(
        Rejection.of(
            vocabulary.USAGE_RECORDS_UNAVAILABLE,
            "The gateway cannot record usage right now (its disk and its database refused "
            "the record), so it cannot answer; nothing is charged for this request. Please "
            "retry.",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    )


def change_not_announced() -> ApiError:
    """The 503 for an admin change saved in the database whose announcement to the other
    replicas (the auth epoch, in Redis) failed: retrying the request announces it."""
    return ApiError(
        Rejection.of(
            vocabulary.SERVICE_UNAVAILABLE,
            "The change is saved, but the gateway could not announce it to its replicas "
            "(Redis did not answer): retry the request to announce it; until then other "
            "replicas apply it within auth_cache_ttl_s.",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    )


ENGINE_FAILED_MESSAGE = "The engine failed while generating this response."
MAX_ENGINE_MESSAGE_CHARS = 1000
_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")


def from_engine_answer(status: int, body: bytes, model: str) -> Rejection:
    """What the client sees for an engine's error answer (status >= 400): the gateway's own
    error, in the shared vocabulary, never the engine's body as it came.

    - 400 (or 422): the request itself is at fault, as if the gateway had refused it: 400
      ``invalid_request_error`` with the engine's code (``context_length_exceeded``, a field
      rule's) and param when it sent them, and its message, which names what is wrong.
    - 413: the body is too large for the engine: 413 ``request_too_large``, its message.
    - 429: the engine is over capacity, not the tenant over its limits: 503
      ``upstream_unavailable`` with ``Retry-After``.
    - any other 4xx (401, 403, 404: the engine does not know the model or the gateway's
      credentials) is the deployment's fault: 502 ``upstream_error``, naming the engine's
      status and code but not its message.
    - 5xx: 502 ``upstream_error``; the engine's message (its internals) stays inside.
    """
    fields = _engine_error_fields(body)
    code = fields.get("code")
    engine_code = code if code is not None and _CODE.fullmatch(code) else None
    message = (fields.get("message") or "")[:MAX_ENGINE_MESSAGE_CHARS]
    if status in (400, 422):
        return invalid_request(
            message or "The engine refused the request.",
            (fields.get("param") or "")[:MAX_ENGINE_MESSAGE_CHARS] or None,
            code=engine_code or vocabulary.INVALID_REQUEST.code,
        ).rejection
    if status == 413:
        return Rejection.of(
            vocabulary.REQUEST_TOO_LARGE, message or "The request is too large for the engine."
        )
    if status == 429:
        return Rejection.of(
            vocabulary.UPSTREAM_UNAVAILABLE,
            f"The engine serving `{model}` is over capacity; please retry.",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if status < 500:
        refused = f"{status} {engine_code}" if engine_code else str(status)
        return Rejection.of(
            vocabulary.UPSTREAM_ERROR,
            f"The engine serving `{model}` refused the gateway's request ({refused}).",
        )
    return Rejection.of(vocabulary.UPSTREAM_ERROR, ENGINE_FAILED_MESSAGE)


def unreadable_engine_answer() -> ApiError:
    """A non-streamed answer whose body is not a JSON object: the engine failed, a 502."""
    return ApiError(Rejection.of(vocabulary.UPSTREAM_ERROR, "Bad engine answer."))


# What a client sees when an engine's stream breaks or carries an error event (its own
# words, e.g. an engine's ``engine_error``, stay inside): the gateway's 502 as an event.
MID_STREAM_ERROR = Rejection.of(
    vocabulary.UPSTREAM_ERROR,
    "The engine failed while generating this response; the tokens sent so far are charged.",
)


# What a request still in flight at a stopping gateway's drain deadline gets
# (`gateway.upstream.drain_deadline`): a 503 to retry (another replica serves it), or a
# stream's last event; billed for what its engine produced either way.
SHUTTING_DOWN = Rejection.of(
    vocabulary.SERVER_SHUTTING_DOWN,
    "The gateway is shutting down and stopped this request before its answer was complete; "
    "retry it. What the engine generated for it is charged.",
    headers={"Retry-After": str(RETRY_AFTER_S)},
)
SHUTTING_DOWN_MID_STREAM = Rejection.of(
    vocabulary.SERVER_SHUTTING_DOWN,
    "The gateway is shutting down and ended this stream; the tokens sent so far are charged.",
)


def _engine_error_fields(body: bytes) -> dict[str, str]:
    """The string fields of an OpenAI-format error body; nothing for anything else."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    error = answer.get("error") if isinstance(answer, dict) else None
    if not isinstance(error, dict):
        return {}
    return {k: v for k, v in error.items() if k in _FIELDS and isinstance(v, str) and v}


_FIELDS = ("message", "code", "param")


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
        return Rejection.of(
            vocabulary.http_error_kind(exc.status_code),
            str(exc.detail),
            headers=exc.headers or {},  # a 405's Allow
        )
    return Rejection.of(vocabulary.INTERNAL_ERROR, "The gateway failed unexpectedly.")


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
