"""``GET /openapi.json``: the OpenAPI 3.1 document of the completion, admin and tenant APIs,
built from the endpoints' docstrings and the pydantic models in :mod:`gateway.api.admin_schemas`,
:mod:`gateway.api.admin_records_api` and :mod:`gateway.api.completion_schemas`."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.schemas import SchemaGenerator

from gateway.api.admin_records_api import AlertEventList, AuditLog
from gateway.api.admin_schemas import DEFAULT_PAGE_SIZE as ADMIN_DEFAULT_PAGE_SIZE
from gateway.api.admin_schemas import MAX_PAGE_SIZE as ADMIN_MAX_PAGE_SIZE
from gateway.api.admin_schemas import (
    TEXT_PATTERN,
    ApiKey,
    ApiKeyCreate,
    ApiKeyList,
    CreatedApiKey,
    Deleted,
    Quota,
    QuotaSettings,
    Tenant,
    TenantCreate,
    TenantList,
    TenantUpdate,
)
from gateway.api.budget_admin_api import ScopedBudgetSettings
from gateway.api.budget_standing import BudgetStanding
from gateway.api.completion_schemas import REQUEST_MODELS as COMPLETION_REQUESTS
from gateway.api.completion_schemas import RESPONSE_MODELS as COMPLETION_RESPONSES
from gateway.api.tenant_api import DEFAULT_PAGE_SIZE, USAGE_FORMATS, Budget, UsageList, UsageSummary
from gateway.storage.alert_outbox import EVENT_STATES
from gateway.storage.usage_store import MAX_PAGE_SIZE
from openai_protocol.errors import ERROR_TYPES
from policies.quota import BUDGET_PERIODS


def openapi_route(
    routes: Sequence[BaseRoute], path: str = "/openapi.json", *, models: Sequence[str] = ()
) -> Route:
    """``GET /openapi.json`` (no auth: it holds no secrets) describing ``routes``; ``models``:
    the names a completion request may send (none: any string)."""
    document = openapi_document(routes, models=models)

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    return Route(path, openapi, methods=["GET"], include_in_schema=False)


def openapi_document(routes: Sequence[BaseRoute], *, models: Sequence[str] = ()) -> dict[str, Any]:
    """OpenAPI 3.1 from the endpoints' docstrings: a summary line, ``---``, then a YAML
    shorthand ``{params: [...], body: Model, 200: Model, errors: [...], streams: bool,
    events: Model}`` whose names refer to the pydantic models and parameters below
    (``streams``: also JSONL and CSV; ``events``: also server-sent events of that model).
    A docstring written in plain OpenAPI passes through unchanged."""
    paths: dict[str, dict[str, Any]] = {}
    for endpoint in SchemaGenerator({}).get_endpoints(list(routes)):
        doc = inspect.getdoc(endpoint.func) or ""
        summary, _, spec = doc.partition("\n---\n")
        parsed = yaml.safe_load(spec) if spec else None
        if isinstance(parsed, dict):
            operation = _operation(endpoint.path, summary.strip(), parsed)
            paths.setdefault(endpoint.path, {})[endpoint.http_method] = operation
    model_names = models
    bodies = [(model, "validation") for model in _BODY_MODELS]
    bodies += [(model, "serialization") for model in _RESPONSE_MODELS]
    _, schemas = models_json_schema(bodies, ref_template=_REF)  # type: ignore[arg-type]
    if model_names:
        for name in _COMPLETION_BODY_NAMES:
            schemas["$defs"][name]["properties"]["model"]["enum"] = sorted(model_names)
    error = {"description": "An error in OpenAI's format", "content": _json_content("Error")}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Tollway", "version": "1"},
        "paths": paths,
        "components": {
            "schemas": {**schemas["$defs"], "Error": _ERROR_SCHEMA},
            "parameters": _PARAMETERS,
            "responses": {"Error": error},
            "securitySchemes": {
                "adminKey": {"type": "http", "scheme": "bearer", "description": "The admin key"},
                "tenantKey": {"type": "http", "scheme": "bearer", "description": "An API key"},
            },
        },
    }


def _operation(path: str, summary: str, spec: dict[Any, Any]) -> dict[str, Any]:
    spec = dict(spec)
    operation: dict[str, Any] = {"summary": summary} if summary else {}
    if path.startswith(("/admin/", "/v1/")):
        operation["security"] = [{"adminKey" if path.startswith("/admin/") else "tenantKey": []}]
    params = spec.pop("params", [])
    if params:
        operation["parameters"] = [{"$ref": f"#/components/parameters/{name}"} for name in params]
    body = spec.pop("body", None)
    if body is not None:
        required = not spec.pop("body_optional", False)
        operation["requestBody"] = {"required": required, "content": _json_content(body)}
    responses: dict[str, Any] = {}
    is_streamed = spec.pop("streams", False)
    event_model = spec.pop("events", None)
    for code in [key for key in spec if isinstance(key, int)]:
        content = _json_content(spec.pop(code))
        if is_streamed:
            content["application/x-ndjson"] = {"schema": {"type": "string"}}
            content["text/csv"] = {"schema": {"type": "string"}}
        if event_model is not None:
            content["text/event-stream"] = _event_stream(event_model)
        responses[str(code)] = {"description": HTTPStatus(code).phrase, "content": content}
    errors = set(spec.pop("errors", [])) | ({401} if "security" in operation else set())
    if _PATH_ID_PARAMETERS.intersection(params):
        errors.add(400)  # admin_inputs.path_id: an encoded slash or backslash in the path
    for code in sorted(errors):
        responses[str(code)] = {"$ref": "#/components/responses/Error"}
    if responses:
        operation["responses"] = responses
    return {**operation, **spec}


def _json_content(schema_name: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF.format(model=schema_name)}}}


def _event_stream(model: str) -> dict[str, Any]:
    """With ``"stream": true``: ``data: <model as JSON>`` events, then ``data: [DONE]``; an
    error after the stream started is one ``data: {"error": ...}`` event before ``[DONE]``."""
    description = f"Each event's data is a {model} as JSON; the last one is [DONE]."
    data = {"type": "string", "description": description}
    return {
        "schema": {"type": "object", "required": ["data"], "properties": {"data": data}},
        "x-event-schema": {"$ref": _REF.format(model=model)},
    }


def _param(name: str, where: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": where,
        "required": where == "path",
        "schema": schema,
        "description": description,
    }


_REF = "#/components/schemas/{model}"
_COMPLETION_BODY_NAMES = [model.__name__ for model in COMPLETION_REQUESTS]
_BODY_MODELS: list[type[BaseModel]] = [
    TenantCreate,
    ScopedBudgetSettings,
    TenantUpdate,
    Quota,
    ApiKeyCreate,
    *COMPLETION_REQUESTS,
]
_RESPONSE_MODELS: list[type[BaseModel]] = [
    *COMPLETION_RESPONSES,
    Tenant,
    TenantList,
    QuotaSettings,
    ApiKey,
    CreatedApiKey,
    ApiKeyList,
    Deleted,
    UsageList,
    UsageSummary,
    Budget,
    BudgetStanding,
    AuditLog,
    AlertEventList,
]
_TIME = {"type": "string", "format": "date-time"}
_PATH_ID = {"type": "string", "pattern": r"^[^/\\]*$"}  # an encoded '/' or '\' is a 400
_PATH_ID_PARAMETERS = {"TenantId", "KeyId", "User"}  # the parameters below with _PATH_ID
_PARAMETERS = {
    "TenantId": _param("tenant_id", "path", _PATH_ID, "The tenant's id"),
    "ModelId": _param(
        "model", "path", {"type": "string"}, "A model, rollout or routing alias (may hold '/')"
    ),
    "KeyId": _param("key_id", "path", _PATH_ID, "The key's id (key_...)"),
    "User": _param("user", "path", _PATH_ID, "An end user: a request's user field"),
    "EndUser": _param(
        "user", "query", {"type": "string"}, "Also this end user's budget (a request's user)"
    ),
    "TenantFilter": _param("tenant_id", "query", {"type": "string"}, "Only this tenant"),
    "OwnTenant": _param(
        "tenant_id", "query", {"type": "string"}, "Optional; any tenant but the caller's: 403"
    ),
    "IncludeDeleted": _param("include_deleted", "query", {"type": "boolean"}, "Default false"),
    "Start": _param("start", "query", _TIME, "Inclusive; ISO 8601, naive is UTC"),
    "End": _param("end", "query", _TIME, "Exclusive; ISO 8601, naive is UTC"),
    "Cursor": _param(
        "cursor",
        "query",
        {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
        "Records with id > cursor: a page's next_cursor or resume_cursor, or a record's id",
    ),
    "Limit": _param(
        "limit",
        "query",
        {"type": "integer", "minimum": 1, "maximum": MAX_PAGE_SIZE},
        f"Page size; json: default {DEFAULT_PAGE_SIZE}; jsonl/csv: default all, streamed",
    ),
    "IdCursor": _param(
        "cursor",
        "query",
        {"type": "string", "minLength": 1, "maxLength": 64, "pattern": TEXT_PATTERN},
        "next_cursor of the page before",
    ),
    "PageLimit": _param(
        "limit",
        "query",
        {"type": "integer", "minimum": 1, "maximum": ADMIN_MAX_PAGE_SIZE},
        f"Page size; default {ADMIN_DEFAULT_PAGE_SIZE}",
    ),
    "RecordCursor": _param(
        "cursor",
        "query",
        {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
        "Entries older than this one: the next_cursor of the page before",
    ),
    "AlertState": _param(
        "state", "query", {"enum": list(EVENT_STATES)}, "Only events in this delivery state"
    ),
    "Format": _param("format", "query", {"enum": list(USAGE_FORMATS)}, "Default json"),
    "Period": _param("period", "query", {"enum": list(BUDGET_PERIODS)}, "Default month"),
}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"enum": sorted(ERROR_TYPES)},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
