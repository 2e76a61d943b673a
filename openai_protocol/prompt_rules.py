"""What a request's prompt may hold: a completion's prompt or list of prompts, and a chat
message's content parts (text only: the models served take no images, audio or files)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openai_protocol.field_errors import FieldError, check_num_items, invalid_type

MAX_CHOICES = 128  # n, times the prompts of a completion's list
MAX_TOKEN_ID = 2**31 - 1

# Content parts OpenAI defines that carry something other than text.
_MEDIA_PARTS = {"image_url": "images", "input_audio": "audio", "file": "files"}


@dataclass(frozen=True)
class Prompt:
    """A completion's ``prompt``: a string, an array of strings, an array of token ids, or an
    array of token-id arrays; one choice per prompt (times ``n``), at most ``MAX_CHOICES``."""

    def check(self, param: str, value: Any) -> None:
        if isinstance(value, str):
            return
        expected = "a string, an array of strings, of token ids, or of token-id arrays"
        if not isinstance(value, list):
            raise invalid_type(param, expected, value)
        if value and all(_is_token_id(t) for t in value):
            return  # one prompt of token ids, as long as the context window allows
        check_num_items(param, value, 1, MAX_CHOICES)
        for n, item in enumerate(value):
            if isinstance(item, str):
                continue
            if not isinstance(item, list) or not all(_is_token_id(t) for t in item):
                raise invalid_type(f"{param}[{n}]", "a string or an array of token ids", item)
            check_num_items(f"{param}[{n}]", item, 1, 2**31)
        if {isinstance(item, str) for item in value} == {True, False}:
            raise invalid_type(param, expected, value)

    def json_schema(self) -> dict[str, Any]:
        token_id = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
        token_ids = {"type": "array", "items": token_id, "minItems": 1}
        return {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {"type": "string"},
                    "minItems": 1,
                    "maxItems": MAX_CHOICES,
                },
                {"type": "array", "items": token_id, "minItems": 1},
                {"type": "array", "items": token_ids, "minItems": 1, "maxItems": MAX_CHOICES},
            ]
        }


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def num_prompts(prompt: Any) -> int:
    """How many prompts a completion's ``prompt`` holds (a token-id array is one)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return len(prompt)
    return 1


def check_content_parts(messages: Any) -> None:
    """Every content part of every message (any role) is a text part: an image, audio or file
    part is refused naming it, rather than its content silently dropped. The shape of the
    rest is the request model's to check."""
    if not isinstance(messages, list):
        return
    for n, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            media = _MEDIA_PARTS.get(kind) if isinstance(kind, str) else None
            if media is not None:
                raise FieldError(
                    f"Invalid 'messages[{n}].content[{k}]': this model takes no {media}; "
                    f"a '{kind}' part cannot be read. Send text parts only.",
                    f"messages[{n}].content[{k}]",
                    "invalid_value",
                )
