"""Whether an answer is one an OpenAI client reads: the openai SDK's response types, and the
fields OpenAI's API reference marks as required.

The SDK's types (``ChatCompletion``, ``ChatCompletionChunk``, ``Completion``) check every
field's type and every enum (``finish_reason``, ``object``), but take a required-but-nullable
field that is absent (``message.refusal``) as null: `missing_required` checks those from
`REQUIRED`, a table copied from OpenAI's API reference (its OpenAPI document's ``required``
lists for the same objects). `check_answer` does both for a whole answer or one streamed
chunk, and `check_event_stream` for every ``data:`` event of a stream (an error event or
``[DONE]`` is not an answer and is skipped). `tests.support.schema_checked_app` applies them
to every answer a gateway sends in a test.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import orjson
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

Kind = Literal["chat", "chat_chunk", "completion", "completion_chunk"]
KIND_BY_PATH: Mapping[str, tuple[Kind, Kind]] = {  # (whole answer, streamed chunk)
    "/v1/chat/completions": ("chat", "chat_chunk"),
    "/v1/completions": ("completion", "completion_chunk"),
}

# Object -> its required fields (OpenAI's API reference); "a.b[]" walks into each item.
_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")
_TOKEN_LOGPROB = ("token", "logprob", "bytes", "top_logprobs")
REQUIRED: Mapping[Kind, Mapping[str, tuple[str, ...]]] = {
    "chat": {
        "": ("id", "object", "created", "model", "choices"),
        "choices[]": ("index", "message", "logprobs", "finish_reason"),
        "choices[].message": ("role", "content", "refusal"),
        "choices[].logprobs": ("content", "refusal"),
        "choices[].logprobs.content[]": _TOKEN_LOGPROB,
        "choices[].logprobs.content[].top_logprobs[]": ("token", "logprob", "bytes"),
        "usage": _USAGE,
    },
    "chat_chunk": {
        "": ("id", "object", "created", "model", "choices"),
        "choices[]": ("index", "delta", "finish_reason"),
        "choices[].logprobs": ("content", "refusal"),
        "choices[].logprobs.content[]": _TOKEN_LOGPROB,
        "usage": _USAGE,
    },
    "completion": {
        "": ("id", "object", "created", "model", "choices"),
        "choices[]": ("index", "text", "logprobs", "finish_reason"),
        "choices[].logprobs": ("tokens", "token_logprobs", "top_logprobs", "text_offset"),
        "usage": _USAGE,
    },
    "completion_chunk": {  # a streamed completion's chunks have the whole answer's shape
        "": ("id", "object", "created", "model", "choices"),
        "choices[]": ("index", "text", "logprobs", "finish_reason"),
        "usage": _USAGE,
    },
}
_SDK_TYPES: Mapping[Kind, type[BaseModel]] = {
    "chat": ChatCompletion,
    "chat_chunk": ChatCompletionChunk,
    "completion": Completion,
    "completion_chunk": Completion,
}


def missing_required(answer: Mapping[str, Any], kind: Kind) -> list[str]:
    """The required fields absent from ``answer`` (paths as OpenAI writes them:
    ``choices[0].message.refusal``); an object that is null or absent has none to miss."""
    missing = []
    for path, fields in REQUIRED[kind].items():
        for where, obj in _objects_at(answer, path):
            missing += [f"{where}.{f}" if where else f for f in fields if f not in obj]
    return missing


def check_answer(answer: Mapping[str, Any], kind: Kind) -> BaseModel:
    """``answer`` as the SDK's type for ``kind``; raises ``AssertionError`` naming the
    required fields it lacks, pydantic's ``ValidationError`` for a field of the wrong type."""
    missing = missing_required(answer, kind)
    assert not missing, f"{kind} lacks OpenAI's required {missing}: {answer}"
    if kind == "completion_chunk":
        answer = _as_sdk_completion_chunk(answer)
    return _SDK_TYPES[kind].model_validate(answer)


def _as_sdk_completion_chunk(chunk: Mapping[str, Any]) -> dict[str, Any]:
    """The SDK reads a streamed completion's chunks as ``Completion``s (built without
    validation), whose ``finish_reason`` is not nullable, though OpenAI's chunks carry null
    until the last: null is checked here, as any other value is by the type."""
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return dict(chunk)
    finished = [
        {**c, "finish_reason": "stop"}
        if isinstance(c, dict) and c.get("finish_reason") is None
        else c
        for c in choices
    ]
    return {**chunk, "choices": finished}


def check_event_stream(body: bytes | str, kind: Kind) -> list[BaseModel]:
    """Every ``data:`` event of a server-sent event stream that is a chunk, checked."""
    text = body.decode() if isinstance(body, bytes) else body
    chunks = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        data = "\n".join(
            line[5:].removeprefix(" ") for line in block.split("\n") if line.startswith("data:")
        )
        if not data or data == "[DONE]":
            continue
        event = orjson.loads(data)
        if isinstance(event, dict) and "error" in event:
            continue
        chunks.append(check_answer(event, kind))
    return chunks


def _objects_at(value: Any, path: str) -> list[tuple[str, Mapping[str, Any]]]:
    """The objects at ``path`` in ``value``, each with where it is."""
    found: list[tuple[str, Any]] = [("", value)]
    for step in [s for s in path.split(".") if s]:
        name, is_each = step.removesuffix("[]"), step.endswith("[]")
        deeper: list[tuple[str, Any]] = []
        for where, obj in found:
            inner = obj.get(name) if isinstance(obj, Mapping) else None
            at = f"{where}.{name}" if where else name
            if is_each and isinstance(inner, list):
                deeper += [(f"{at}[{i}]", item) for i, item in enumerate(inner)]
            elif not is_each and inner is not None:
                deeper.append((at, inner))
        found = deeper
    return [(where, obj) for where, obj in found if isinstance(obj, Mapping)]
