"""The error vocabulary both Tollway servers speak: the body's shape, OpenAI's error types,
the type each status has, and the codes the engine and the gateway share.

Every error body is ``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``.
``type`` is OpenAI's broad class of error and follows from the status (:func:`type_for`),
but for ``model_not_found`` (OpenAI's 404 ``invalid_request_error``);
``code`` names the reason, machine-readable. The engine server builds its errors from this
table and the gateway builds its own from the same one, so an engine's ``engine_error`` and
the gateway's ``upstream_error`` are both ``server_error``s, and a code means the same thing
whichever process sent it. What the gateway shows a client for an engine's error is the
gateway's decision (``gateway.errors.from_engine_answer``), made in these words.

Plain Python: the engine, the gateway and the policies all import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

# OpenAI's error types.
INVALID_REQUEST_ERROR: Final = "invalid_request_error"
PERMISSION_ERROR: Final = "permission_error"
NOT_FOUND_ERROR: Final = "not_found_error"
RATE_LIMIT_ERROR: Final = "rate_limit_error"
INSUFFICIENT_QUOTA: Final = "insufficient_quota"
SERVER_ERROR: Final = "server_error"

ERROR_TYPES: Final = frozenset(
    {
        INVALID_REQUEST_ERROR,
        PERMISSION_ERROR,
        NOT_FOUND_ERROR,
        RATE_LIMIT_ERROR,
        INSUFFICIENT_QUOTA,
        SERVER_ERROR,
    }
)

# The type of an error with each status; a 401 is an invalid request in OpenAI's API (its
# code says ``invalid_api_key``), and a budget's 429 is ``insufficient_quota``, set by its code.
TYPE_BY_STATUS: Final[Mapping[int, str]] = MappingProxyType(
    {
        400: INVALID_REQUEST_ERROR,
        401: INVALID_REQUEST_ERROR,
        403: PERMISSION_ERROR,
        404: NOT_FOUND_ERROR,
        405: INVALID_REQUEST_ERROR,
        409: INVALID_REQUEST_ERROR,
        413: INVALID_REQUEST_ERROR,
        415: INVALID_REQUEST_ERROR,
        422: INVALID_REQUEST_ERROR,
        429: RATE_LIMIT_ERROR,
    }
)


def type_for(status: int) -> str:
    """OpenAI's error type for an error with ``status``: ``server_error`` for every 5xx."""
    if status >= 500:
        return SERVER_ERROR
    return TYPE_BY_STATUS.get(status, INVALID_REQUEST_ERROR)


@dataclass(frozen=True)
class ErrorKind:
    """One entry of the vocabulary: a code, the status it is sent with, and its type."""

    code: str
    status: int
    type: str


def _kind(code: str, status: int) -> ErrorKind:
    return ErrorKind(code, status, type_for(status))


# Codes both servers may send (the request-field codes of ``field_rules`` are 400s too).
INVALID_REQUEST: Final = _kind("invalid_request", 400)
INVALID_JSON: Final = _kind("invalid_json", 400)
CONTEXT_LENGTH_EXCEEDED: Final = _kind("context_length_exceeded", 400)
# OpenAI's one exception to "the type follows from the status": an unknown model is a 404 of
# type ``invalid_request_error`` (clients map the status, some read the type).
MODEL_NOT_FOUND: Final = ErrorKind("model_not_found", 404, INVALID_REQUEST_ERROR)
REQUEST_TOO_LARGE: Final = _kind("request_too_large", 413)
UNSUPPORTED_CONTENT_ENCODING: Final = _kind("unsupported_content_encoding", 415)
INTERNAL_ERROR: Final = _kind("internal_error", 500)  # a bug: nothing more is said
# The engine's.
ENGINE_ERROR: Final = _kind("engine_error", 500)  # this request failed in the engine
ENGINE_NOT_READY: Final = _kind("engine_not_ready", 503)  # still loading its weights
ENGINE_DRAINING: Final = _kind("engine_draining", 503)  # stopping: it takes no new requests
# The gateway's.
INVALID_API_KEY: Final = _kind("invalid_api_key", 401)
UPSTREAM_ERROR: Final = _kind("upstream_error", 502)  # an engine failed or answered wrongly
UPSTREAM_UNAVAILABLE: Final = _kind("upstream_unavailable", 503)  # no engine could take it
SERVICE_UNAVAILABLE: Final = _kind("service_unavailable", 503)  # Redis or the database
SERVER_SHUTTING_DOWN: Final = _kind("server_shutting_down", 503)  # ended at a drain's deadline
# Neither the spill file nor the database took the request's usage record: no answer.
USAGE_RECORDS_UNAVAILABLE: Final = _kind("usage_records_unavailable", 503)

VOCABULARY: Final[Mapping[str, ErrorKind]] = MappingProxyType(
    {
        kind.code: kind
        for kind in (
            INVALID_REQUEST,
            INVALID_JSON,
            CONTEXT_LENGTH_EXCEEDED,
            MODEL_NOT_FOUND,
            REQUEST_TOO_LARGE,
            UNSUPPORTED_CONTENT_ENCODING,
            INTERNAL_ERROR,
            ENGINE_ERROR,
            ENGINE_NOT_READY,
            ENGINE_DRAINING,
            INVALID_API_KEY,
            UPSTREAM_ERROR,
            UPSTREAM_UNAVAILABLE,
            SERVICE_UNAVAILABLE,
            SERVER_SHUTTING_DOWN,
            USAGE_RECORDS_UNAVAILABLE,
        )
    }
)


# How much of a client's id (a model, a tenant, a key) an error message quotes.
MAX_ECHOED_ID_CHARS: Final = 64


def echoed_id(text: str, max_chars: int = MAX_ECHOED_ID_CHARS) -> str:
    """``text`` as an error quotes it: its first ``max_chars`` characters, then ``...``. An
    id from a path or body can be as long as the request, and need not grow the answer."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + "..."


def model_not_found_message(model: str) -> str:
    """OpenAI's sentence for a model that does not exist, or that the caller may not use."""
    return f"The model `{echoed_id(model)}` does not exist or you do not have access to it."


def http_error_kind(status: int) -> ErrorKind:
    """A routing error's kind (no such route, method not allowed...): ``http_<status>``."""
    return _kind(f"http_{status}", status)


ErrorBody = dict[str, dict[str, str | None]]


def error_body(message: str, type: str, code: str | None, param: str | None = None) -> ErrorBody:
    """The JSON body OpenAI clients expect."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
