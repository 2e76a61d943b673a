"""A request body as a JSON object, nested at most ``MAX_JSON_DEPTH`` deep.

The gateway and the engine server both parse with this. orjson is fast, refuses NaN,
Infinity and lone surrogates (none of which can be stored or re-encoded), and stops at
1,024 levels itself; nothing we accept needs more than a few, so anything deeper than
``MAX_JSON_DEPTH`` is refused before recursive code (encoders, validators) walks it.

The depth check costs nothing on ordinary bodies: a body with no more than ``max_depth``
brackets in all cannot nest deeper, and counting them is a C scan of the bytes. Only a
body with more brackets has its parsed containers walked, without recursion.
"""

from __future__ import annotations

from typing import Any

import orjson

from openai_protocol.errors import INVALID_JSON
from openai_protocol.field_rules import MAX_JSON_DEPTH, FieldError


def parse_json_object(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """The body's JSON object; :class:`FieldError` (``invalid_json``) for anything else."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc) or "recursion" in str(exc):
            raise _too_deep(max_depth) from None
        raise FieldError(
            f"We could not parse the JSON body of your request: {exc}.", None, INVALID_JSON.code
        ) from None
    if not isinstance(data, dict):
        raise FieldError("The request body must be a JSON object.", None, INVALID_JSON.code)
    if body.count(b"[") + body.count(b"{") > max_depth and _is_deeper_than(data, max_depth):
        raise _too_deep(max_depth)
    return data


def _too_deep(max_depth: int) -> FieldError:
    return FieldError(
        f"The JSON body of your request is nested too deeply: at most {max_depth} levels of "
        "arrays and objects are allowed.",
        None,
        INVALID_JSON.code,
    )


def _is_deeper_than(value: dict[str, Any] | list[Any], max_depth: int) -> bool:
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False
