"""The one value every policy returns to refuse a request: a `Rejection`.

A policy returns ``Rejection | None`` (``None``: nothing to object to) or a small
decision dataclass of its own whose refusal case is a `Rejection`. The gateway
turns a `Rejection` into an HTTP response with `error_body` and `headers`; no
handler builds an error body by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from openai_protocol.errors import ERROR_TYPES, ErrorBody, ErrorKind, error_body


@dataclass(frozen=True)
class Rejection:
    """A refusal in OpenAI's error format.

    ``type`` is OpenAI's error type (``invalid_request_error``, ``insufficient_quota``,
    ``rate_limit_error``, ``permission_error``, ``not_found_error``, ``server_error``: one of
    the vocabulary's, `openai_protocol.errors`, which the engine speaks too), ``code`` the
    machine-readable reason (``context_length_exceeded``, ``rate_limit_exceeded``...),
    ``param`` the request field at fault, if any. ``headers`` go on the HTTP response
    (``Retry-After``, ``x-ratelimit-*``); they are copied into a read-only mapping.
    """

    status: int
    code: str
    type: str
    message: str
    param: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 400 <= self.status <= 599:
            raise ValueError(f"a rejection needs a 4xx or 5xx status, got {self.status}")
        if self.type not in ERROR_TYPES:
            raise ValueError(f"{self.type!r} is not an error type of openai_protocol.errors")
        object.__setattr__(self, "headers", MappingProxyType(dict(self.headers)))

    @classmethod
    def of(
        cls,
        kind: ErrorKind,
        message: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Rejection:
        """A refusal of one of the vocabulary's kinds (its status, code and type)."""
        return cls(kind.status, kind.code, kind.type, message, param, headers or {})

    def error_body(self) -> ErrorBody:
        """The JSON body OpenAI clients expect: ``{"error": {message, type, param, code}}``."""
        return error_body(self.message, self.type, self.code, self.param)
