"""Reading and validating a completion request body: bounded, JSON, the fields the gateway uses.

The gateway checks only what it acts on (model, prompt or messages, max_tokens, stream,
stream_options); every other field is passed to the engine untouched, which validates it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from starlette.requests import ClientDisconnect, Request

from gateway.api_errors import ApiError, body_too_large, invalid_request

Endpoint = Literal["chat", "completions"]
Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class CompletionBody:
    """One validated request. ``raw`` is the client's JSON object, forwarded nearly as is."""

    endpoint: Endpoint
    raw: dict[str, Any]
    model: str
    messages: Messages | None  # chat
    prompt: str | list[int] | None  # completions
    max_tokens: int | None
    is_stream: bool
    include_usage: bool

    @property
    def prompt_text(self) -> str:
        """The user-visible text, for routing heuristics (never logged)."""
        if self.messages is not None:
            return "\n".join(_content_text(m.get("content")) for m in self.messages)
        return self.prompt if isinstance(self.prompt, str) else ""

    @property
    def num_turns(self) -> int:
        return len(self.messages) if self.messages is not None else 1

    @property
    def prompt_chars(self) -> int:
        """Characters of prompt text (0 for token ids): what counting its tokens costs."""
        if self.messages is not None:
            return sum(len(_content_text(m.get("content"))) for m in self.messages)
        return len(self.prompt) if isinstance(self.prompt, str) else 0


async def read_json(request: Request, max_body_bytes: int) -> dict[str, Any]:
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
        data = json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid_request(
            f"We could not parse the JSON body of your request: {exc}.", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.", code="invalid_json")
    return data


def parse_body(data: dict[str, Any], endpoint: Endpoint) -> CompletionBody:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise _type_error("model", "a non-empty string")
    messages: Messages | None = None
    prompt: str | list[int] | None = None
    if endpoint == "chat":
        messages = _messages(data.get("messages"))
    else:
        prompt = _prompt(data.get("prompt"))
    max_tokens = _optional_int(data, "max_completion_tokens") if endpoint == "chat" else None
    if max_tokens is None:
        max_tokens = _optional_int(data, "max_tokens")
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _type_error("stream", "a boolean")
    options = data.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _type_error("stream_options", "an object")
        flag = options.get("include_usage", False)
        if not isinstance(flag, bool):
            raise _type_error("stream_options.include_usage", "a boolean")
        include_usage = flag
    return CompletionBody(
        endpoint, data, model, messages, prompt, max_tokens, stream, include_usage
    )


def _type_error(param: str, expected: str) -> ApiError:
    return invalid_request(f"Invalid type for '{param}': expected {expected}.", param=param)


def _optional_int(data: dict[str, Any], name: str) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer")
    if value < 1:
        raise invalid_request(f"{name} must be at least 1, got {value}.", param=name)
    return value


def _messages(value: Any) -> Messages:
    if not isinstance(value, list) or not value:
        raise _type_error("messages", "a non-empty array of messages")
    for n, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _type_error(f"messages[{n}]", "an object with a string 'role'")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _type_error(f"messages[{n}].content", "a string or an array of parts")
    return value


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return str(value[0])
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return [int(t) for t in value]
    raise _type_error("prompt", "a string or an array of token ids")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""
