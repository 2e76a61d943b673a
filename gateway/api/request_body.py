"""Reading and validating a completion request body: bounded, JSON, every field OpenAI defines.

The body is read up to ``max_body_bytes`` (413 beyond), uncompressed only (415 for any
``Content-Encoding``), and parsed with a nesting cap (``openai_protocol.json_body``).
The fields are checked against the table the engine server checks too
(``openai_protocol.field_rules``): ranges, integer widths, counts and lengths, tools and
output constraints with the bounds of their JSON Schemas, so a value the engine could not
run is a 400 here. Messages are only checked for their shape here (an object with a string
``role``, content a string, parts or null: tool turns, the developer role and an assistant's
``tool_calls`` with null content pass); the engine's request model checks the turns, and the
token counter renders them as the engine does, a message it cannot read a 400 naming it.
``null`` is "not given" for every optional field and is not forwarded. Fields outside the
table are passed to the engine untouched. A completion's ``prompt`` (a string, token ids, or
a list of either, as the field rules allow) becomes its list of prompts, each answered with
``n`` choices.
The result is a `gateway.completion_body.CompletionBody`, the type admission reads.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import ClientDisconnect, Request

from gateway.completion_body import ROUTING_HINTS, CompletionBody, Messages, Prompt
from gateway.errors import ApiError, body_too_large, invalid_request, unsupported_encoding
from openai_protocol.field_errors import missing_parameter
from openai_protocol.field_rules import (
    RULES,
    Endpoint,
    FieldError,
    check_fields,
    drop_nulls,
)
from openai_protocol.json_body import parse_json_object


async def read_json(request: Request, max_body_bytes: int) -> dict[str, Any]:
    encoding = request.headers.get("content-encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise unsupported_encoding(encoding)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise body_too_large(max_body_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise body_too_large(max_body_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise invalid_request("The client closed the connection while sending.") from None
    try:
        return parse_json_object(b"".join(chunks))
    except FieldError as exc:
        raise _refusal(exc) from None


def requested_model(data: dict[str, Any]) -> str:
    """The model a body asks for, for its usage record: ``""`` unless it is a valid name
    (a refused body still gets a record, and the database must be able to store it)."""
    model = data.get("model")
    try:
        RULES["chat"]["model"].check("model", model)
    except FieldError:
        return ""
    return str(model)


def parse_body(data: dict[str, Any], endpoint: Endpoint) -> CompletionBody:
    data = drop_nulls(data)
    try:
        check_fields(data, endpoint)
    except FieldError as exc:
        raise _refusal(exc) from None
    model = data.get("model")
    if model is None:
        raise _type_error("model", "a non-empty string")
    if data.get("tollway_hint", "small") not in ROUTING_HINTS:
        raise invalid_request(
            "Invalid value for 'tollway_hint': expected 'small' or 'large'.",
            param="tollway_hint",
            code="unsupported_value",
        )
    messages: Messages | None = None
    prompts: tuple[Prompt, ...] | None = None
    if endpoint == "chat":
        messages = _messages(data.get("messages"))
        max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    else:
        prompts = _prompts(data.get("prompt"))
        max_tokens = data.get("max_tokens")
    options = data.get("stream_options") or {}
    return CompletionBody(
        endpoint,
        data,
        model,
        messages,
        prompts,
        max_tokens,
        data.get("stream", False),
        options.get("include_usage", False),
        data.get("n", 1),
    )


def _refusal(exc: FieldError) -> ApiError:
    return invalid_request(exc.message, exc.param, code=exc.code)


def _type_error(param: str, expected: str) -> ApiError:
    return invalid_request(f"Invalid type for '{param}': expected {expected}.", param=param)


def _messages(value: Any) -> Messages:
    if not isinstance(value, list) or not value:
        raise _type_error("messages", "a non-empty array of messages")
    for n, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _type_error(f"messages[{n}]", "an object with a string 'role'")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _type_error(f"messages[{n}].content", "a string or an array of parts")
        if content == []:
            raise invalid_request(
                f"Invalid 'messages[{n}].content': array too short. Expected an array with "
                "minimum length 1, but got an empty array instead.",
                f"messages[{n}].content",
                code="empty_array",
            )
    return value


def _prompts(value: Any) -> tuple[Prompt, ...]:
    """Each prompt of ``prompt``, whose shape the field rules checked: a string, token ids,
    or a list of strings or of token-id lists (never mixed, never empty)."""
    if value is None:
        raise _refusal(missing_parameter("prompt"))
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:  # the field rule refused these already
        raise _type_error("prompt", "a string, an array of strings or of token ids")
    if all(_is_token_id(t) for t in value):
        return ([int(t) for t in value],)
    return tuple(p if isinstance(p, str) else [int(t) for t in p] for p in value)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
