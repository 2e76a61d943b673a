"""Reading one API request: a bounded body, a validated model, and the routing headers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from backend_engine.request_priority import Priority
from backend_engine.server.errors import (
    body_too_large,
    from_field_error,
    from_validation_error,
    invalid_request,
    unsupported_encoding,
)
from openai_protocol.field_rules import Endpoint, FieldError, check_fields, drop_nulls
from openai_protocol.json_body import parse_json_object

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_TENANT = "default"
_MAX_TENANT_ID_CHARS = 128

ModelT = TypeVar("ModelT", bound=BaseModel)


@dataclass(frozen=True)
class RequestMeta:
    """What the headers say about a request: who sends it and how urgent it is."""

    tenant_id: str
    priority: Priority


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) as soon as it is known to exceed ``max_bytes``, and
    (415) any ``Content-Encoding``: bodies are read uncompressed only."""
    encoding = request.headers.get("content-encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise unsupported_encoding(encoding)
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise body_too_large(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise body_too_large(max_bytes)
    return bytes(body)


async def read_model(
    request: Request,
    model_type: type[ModelT],
    max_bytes: int,
    *,
    endpoint: Endpoint | None = None,
) -> ModelT:
    """The body as ``model_type``. For a generation ``endpoint``, null fields are dropped
    (they take their defaults) and the sampling fields are checked against ``field_rules``
    first, as the gateway checks them."""
    body = await read_body(request, max_bytes)
    if not body.strip():
        raise invalid_request("Request body is empty; expected a JSON object")
    try:
        data: dict[str, Any] = parse_json_object(body)
        if endpoint is not None:
            data = drop_nulls(data)
            check_fields(data, endpoint)
    except FieldError as exc:
        raise from_field_error(exc) from None
    try:
        return model_type.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def read_meta(request: Request) -> RequestMeta:
    tenant_id = request.headers.get("x-tenant-id", "").strip() or DEFAULT_TENANT
    if len(tenant_id) > _MAX_TENANT_ID_CHARS:
        raise invalid_request(
            f"x-tenant-id must be at most {_MAX_TENANT_ID_CHARS} characters", param="x-tenant-id"
        )
    raw_priority = request.headers.get("x-priority", "").strip()
    try:
        priority = Priority.parse(raw_priority) if raw_priority else Priority.INTERACTIVE
    except ValueError as exc:
        raise invalid_request(f"x-priority: {exc}", param="x-priority") from None
    return RequestMeta(tenant_id=tenant_id, priority=priority)
