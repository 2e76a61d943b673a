"""A request body as a JSON object, nested at most ``MAX_JSON_DEPTH`` deep, with no key
given twice in one object.

The gateway and the engine server both parse with this. orjson is fast, refuses NaN,
Infinity and lone surrogates (none of which can be stored or re-encoded), and stops at
1,024 levels itself; nothing we accept needs more than a few, so anything deeper than
``MAX_JSON_DEPTH`` is refused before recursive code (encoders, validators) walks it.

The depth check costs nothing on ordinary bodies: a body with no more than ``max_depth``
brackets in all cannot nest deeper, and counting them is a C scan of the bytes. Only a
body with more brackets has its parsed containers walked, without recursion.

orjson keeps the last of two equal keys, so ``{"max_tokens": 1, "max_tokens": 9999}``
would pass a check on one value and mean another to a reader that keeps the first: a
duplicated key is a 400 (``invalid_json``) naming it. Proving there is none is cheap: each
key in the text ends with ``"`` and a colon, so if the parsed objects hold as many keys as
the body has colons (or, failing that, as many as ``"``-then-colon sequences) no key was
given twice. Counting the parsed keys walks containers only until every ``{`` in the body
is accounted for, so a long list of token ids is never walked. Only a body whose strings
hold colons after a quote is parsed a second time, by the standard library, to find the key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import orjson

from openai_protocol.errors import INVALID_JSON, echoed_id
from openai_protocol.field_rules import MAX_JSON_DEPTH, FieldError

# A key's end in JSON text: its closing quote, optional whitespace, the colon.
_KEY_END = re.compile(rb'"[ \t\n\r]*:')


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
    num_keys = _num_keys(data, body.count(b"{"))
    if num_keys != body.count(b":") and num_keys != len(_KEY_END.findall(body)):
        _refuse_duplicate_keys(body)
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


def _num_keys(root: dict[str, Any], num_braces: int) -> int:
    """The keys of every object under ``root``; stops once ``num_braces`` objects are seen,
    as the body cannot hold more (a ``{`` inside a string only makes the bound loose)."""
    num_keys = 0
    num_objects = 0
    stack: list[dict[str, Any] | list[Any]] = [root]
    while stack and num_objects < num_braces:
        node = stack.pop()
        if type(node) is dict:
            num_objects += 1
            num_keys += len(node)
            children: Iterable[Any] = node.values()
        else:
            children = node
        for child in children:
            if type(child) is dict or type(child) is list:
                stack.append(child)
    return num_keys


def _refuse_duplicate_keys(body: bytes) -> None:
    """Parses ``body`` (valid JSON: orjson read it) again, seeing every key of every object."""
    json.loads(
        body,
        object_pairs_hook=_object_without_duplicates,
        parse_int=_ignored,
        parse_float=_ignored,
        parse_constant=_ignored,
    )


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> None:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise FieldError(
                "We could not parse the JSON body of your request: the key "
                f"'{echoed_id(key)}' appears more than once in one object.",
                None,
                INVALID_JSON.code,
            )
        seen.add(key)


def _ignored(_: str) -> None:
    return None
