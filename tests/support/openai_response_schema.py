"""Whether an answer is one an OpenAI client reads: the openai SDK's response types, and the
fields OpenAI's API reference marks as required.

The SDK's types (``ChatCompletion``, ``ChatCompletionChunk``, ``Completion``) check every
field's type and every enum (``finish_reason``, ``object``), but take a required-but-nullable
field that is absent (``message.refusal``) as null: `missing_required` checks those from
`REQUIRED`, a table copied from OpenAI's API reference (its OpenAPI document's ``required``
lists for the same objects), plus ``system_fingerprint``, which Tollway's answers always
carry. Where OpenAI's API itself sends what the SDK's types do not allow (a streamed text
completion's null ``finish_reason``, an echoed prompt's null first logprob), and for
Tollway's two ``finish_reason`` extensions, the value is checked as the SDK reads it.

`check_answer` does both for a whole answer or one streamed chunk, and `check_event_stream`
for every ``data:`` event of a stream (an error event or ``[DONE]`` is not an answer and is
skipped). `tests.support.schema_checked_app` applies them to every answer a gateway sends in
a test.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import orjson
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

Kind = Literal["chat", "chat_chunk", "completion", "completion_chunk"]
TOLLWAY_FINISH_REASONS = frozenset({"abort", "error"})
KIND_BY_PATH: Mapping[str, tuple[Kind, Kind]] = {  # (whole answer, streamed chunk)
    "/v1/chat/completions": ("chat", "chat_chunk"),
    "/v1/completions": ("completion", "completion_chunk"),
}

# Object -> its required fields (OpenAI's API reference); "a.b[]" walks into each item.
_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")
# OpenAI's reference leaves system_fingerprint optional; issue #26 has every answer carry it.
_ANSWER = ("id", "object", "created", "model", "system_fingerprint", "choices")
_TOKEN_LOGPROB = ("token", "logprob", "bytes", "top_logprobs")
REQUIRED: Mapping[Kind, Mapping[str, tuple[str, ...]]] = {
    "chat": {
        "": _ANSWER,
        "choices[]": ("index", "message", "logprobs", "finish_reason"),
        "choices[].message": ("role", "content", "refusal"),
        "choices[].logprobs": ("content", "refusal"),
        "choices[].logprobs.content[]": _TOKEN_LOGPROB,
        "choices[].logprobs.content[].top_logprobs[]": ("token", "logprob", "bytes"),
        "usage": _USAGE,
    },
    "chat_chunk": {
        "": _ANSWER,
        "choices[]": ("index", "delta", "finish_reason"),
        "choices[].logprobs": ("content", "refusal"),
        "choices[].logprobs.content[]": _TOKEN_LOGPROB,
        "usage": _USAGE,
    },
    "completion": {
        "": _ANSWER,
        "choices[]": ("index", "text", "logprobs", "finish_reason"),
        "choices[].logprobs": ("tokens", "token_logprobs", "top_logprobs", "text_offset"),
        "usage": _USAGE,
    },
    "completion_chunk": {  # a streamed completion's chunks have the whole answer's shape
        "": _ANSWER,
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
    return _SDK_TYPES[kind].model_validate(_as_sdk_reads_it(answer, kind))


def _as_sdk_reads_it(answer: Mapping[str, Any], kind: Kind) -> dict[str, Any]:
    """``answer`` with the values OpenAI's API (or Tollway, as an extension) sends but the
    SDK's generated types, which the SDK builds without validating, do not allow, each
    replaced by one they do; anything else is left for the type to check:

    - a streamed text completion's ``finish_reason`` is null until its last chunk (the SDK
      reads those chunks as ``Completion``s);
    - an echoed prompt's first token has no logprob: null in ``token_logprobs`` and
      ``top_logprobs``;
    - Tollway's ``finish_reason`` extensions: ``abort`` (stopped by ``/abort_request``) and
      ``error`` (one choice failed in the engine while the others went on).
    """
    choices = answer.get("choices")
    if not isinstance(choices, list):
        return dict(answer)
    read = []
    for choice in choices:
        if not isinstance(choice, dict):
            read.append(choice)
            continue
        choice = dict(choice)
        reason = choice.get("finish_reason")
        is_unfinished_chunk = kind == "completion_chunk" and reason is None
        if is_unfinished_chunk or reason in TOLLWAY_FINISH_REASONS:
            choice["finish_reason"] = "stop"
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and "token_logprobs" in logprobs:
            choice["logprobs"] = {
                **logprobs,
                "token_logprobs": _nulls_as(logprobs.get("token_logprobs"), 0.0),
                "top_logprobs": _nulls_as(logprobs.get("top_logprobs"), {}),
            }
        read.append(choice)
    return {**answer, "choices": read}


def _nulls_as(values: Any, value: Any) -> Any:
    return [value if v is None else v for v in values] if isinstance(values, list) else values


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
