"""Reading admin requests: a JSON body into its pydantic model, query flags, page cursors
and ids from the path, each refused in OpenAI's error format with the field named.

Lists are paged as the usage export is: ``limit`` (1 to ``MAX_PAGE_SIZE``, default
``DEFAULT_PAGE_SIZE``) and ``cursor``, the ``next_cursor`` of the page before; here a cursor
is the last id of that page.

A path id the database cannot hold (a NUL, which PostgreSQL's ``text`` refuses, or a lone
surrogate) names nothing: it is a 404 without a query. A path holding an encoded slash or
backslash (``%2F``, ``%5C``) is a 400: routing reads the decoded path, so
``/admin/tenants/a%2Fkeys`` would otherwise answer as tenant ``a``'s keys.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from gateway.api.admin_schemas import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    NAME_PATTERN,
    NON_BLANK_PATTERN,
    TENANT_ID_PATTERN,
    TEXT_PATTERN,
)
from gateway.api.request_body import read_json
from gateway.api.tenant_api import parse_int
from gateway.errors import ApiError, invalid_request
from openai_protocol.errors import echoed_id
from policies.decision import Rejection

MAX_BODY_BYTES = 64 * 1024
_HINTS = {
    "tier": " Set a tenant's tier with PATCH /admin/tenants/{tenant_id}.",
    "quota": " Replace a quota with PUT /admin/tenants/{tenant_id}/quota.",
}
_PATTERN_RULES = {
    TEXT_PATTERN: "text without NUL characters",
    NON_BLANK_PATTERN: "a name that is not blank and has no NUL characters",
    TENANT_ID_PATTERN: "1 to 64 of A-Z, a-z, 0-9, '.', '_', '-', starting with a letter or digit",
    NAME_PATTERN: "text without NUL characters, bidirectional controls (U+202A-U+202E, "
    "U+2066-U+2069, U+200E, U+200F) or zero-width characters (U+200B-U+200D, U+2060, U+FEFF)",
}
MAX_CURSOR_LENGTH = 64  # the longest tenant id; key ids are shorter
Model = TypeVar("Model", bound=BaseModel)
_ENCODED_SEPARATOR = re.compile(rb"%(?:2f|5c)", re.IGNORECASE)


async def read_model(request: Request, model: type[Model]) -> Model:
    data = await read_json(request, MAX_BODY_BYTES)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(part) for part in error["loc"]) or None
        if error["type"] == "extra_forbidden":
            message = f"Unknown field '{param}'.{_HINTS.get(param or '', '')}"
        elif error["type"] == "string_pattern_mismatch":
            rule = _PATTERN_RULES.get(str((error.get("ctx") or {}).get("pattern")), error["msg"])
            message = f"Invalid '{param}': {rule}."
        else:
            message = f"Invalid '{param}': {error['msg']}."
        raise invalid_request(message, param=param) from None


def parse_bool(params: Mapping[str, str], name: str) -> bool:
    value = params.get(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise invalid_request(f"Invalid '{name}': use true or false.", param=name)
    return value in ("true", "1")


@dataclass(frozen=True)
class PageQuery:
    cursor: str | None  # the last id of the page before; None: the first page
    limit: int


def parse_page(params: Mapping[str, str]) -> PageQuery:
    """``cursor`` and ``limit`` of a listing; an empty ``cursor=`` is a 400, as elsewhere."""
    limit = parse_int(params, "limit", 1, MAX_PAGE_SIZE)
    cursor = params.get("cursor")
    if cursor is not None and not (0 < len(cursor) <= MAX_CURSOR_LENGTH and is_storable(cursor)):
        raise invalid_request(
            "Invalid 'cursor': pass the next_cursor of the page before, "
            f"got {echoed_id(cursor)!r}.",
            param="cursor",
        )
    return PageQuery(cursor=cursor, limit=DEFAULT_PAGE_SIZE if limit is None else limit)


def path_id(request: Request, name: str, what: str) -> str:
    """A path parameter naming a stored row; one the database could not hold is a 404, and
    a path with an encoded separator, which may have moved the id's end, a 400."""
    raw_path = request.scope.get("raw_path")
    if isinstance(raw_path, bytes) and _ENCODED_SEPARATOR.search(raw_path.split(b"?", 1)[0]):
        raise invalid_request(
            f"Invalid '{name}': a path id may not contain an encoded '/' or '\\' (%2F or %5C).",
            param=name,
            code="invalid_path",
        )
    value = str(request.path_params[name])
    if not is_storable(value):
        raise not_found(what, value)
    return value


def is_storable(text: str) -> bool:
    """Whether ``text`` can be a database value (PostgreSQL's ``text`` refuses NUL; lone
    surrogates cannot be encoded as UTF-8): a lookup of anything else finds nothing."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def not_found(what: str, name: str, param: str | None = None) -> ApiError:
    return ApiError(
        Rejection(
            404,
            f"{what.replace(' ', '_').lower()}_not_found",
            "not_found_error",
            f"No {what} {echoed_id(name)!r}.",
            param,
        )
    )
