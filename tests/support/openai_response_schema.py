"""Whether an answer is one an OpenAI client reads: the openai SDK's response types, and the
fields OpenAI's API reference marks as required. The one such check: the engine server's
tests (`tests.backend_engine.server.response_schema`) and the gateway's
(`tests.support.schema_checked_app`) both run it.

The SDK's types (``ChatCompletion``, ``ChatCompletionChunk``, ``Completion``) check every
field's type and every enum (``finish_reason``, ``object``), but take a required-but-nullable
field that is absent (``message.refusal``) as null: `missing_required` checks those from
`REQUIRED`, a table copied from OpenAI's API reference (its OpenAPI document's ``required``
lists for the same objects), plus what Tollway's answers always carry though the reference
leaves it optional: ``system_fingerprint`` (``fp_...``), a whole answer's ``usage`` and a
chat chunk's ``logprobs`` (null when not asked for). A chunk with choices carries no usage
(null at most: only the stream's last chunk, with none, has it). Where OpenAI's API itself
sends what the SDK's types do not allow (a streamed text completion's null
``finish_reason``, an echoed prompt's null first logprob), and for Tollway's two
``finish_reason`` extensions, the value is checked as the SDK reads it, nowhere else.

`check_answer` does all of it for a whole answer or one streamed chunk, and
`check_event_stream` for every ``data:`` event of a stream (an error event or ``[DONE]`` is
not an answer and is skipped). `kind_of` names the kind an answer's ``object`` says it is.
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
KIND_BY_OBJECT: Mapping[tuple[str, bool], Kind] = {  # (object, is a streamed chunk)
    ("chat.completion", False): "chat",
    ("chat.completion.chunk", True): "chat_chunk",
    ("text_completion", False): "completion",
    ("text_completion", True): "completion_chunk",
}
CHUNK_KINDS: frozenset[Kind] = frozenset({"chat_chunk", "completion_chunk"})

# Object -> its required fields (OpenAI's API reference); "a.b[]" walks into each item.
_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")
# OpenAI's reference leaves system_fingerprint optional; issue #26 has every answer carry it,
# and Tollway's whole answers always carry their usage.
_CHUNK = ("id", "object", "created", "model", "system_fingerprint", "choices")
_ANSWER = (*_CHUNK, "usage")
_CHAT_LOGPROBS: Mapping[str, tuple[str, ...]] = {
    "choices[].logprobs": ("content", "refusal"),
    "choices[].logprobs.content[]": ("token", "logprob", "bytes", "top_logprobs"),
    "choices[].logprobs.content[].top_logprobs[]": ("token", "logprob", "bytes"),
}
_COMPLETION_CHOICES: Mapping[str, tuple[str, ...]] = {
    "choices[]": ("index", "text", "logprobs", "finish_reason"),
    "choices[].logprobs": ("tokens", "token_logprobs", "top_logprobs", "text_offset"),
}
REQUIRED: Mapping[Kind, Mapping[str, tuple[str, ...]]] = {
    "chat": {
        "": _ANSWER,
        "choices[]": ("index", "message", "logprobs", "finish_reason"),
        "choices[].message": ("role", "content", "refusal"),
        **_CHAT_LOGPROBS,
        "usage": _USAGE,
    },
    "chat_chunk": {
        "": _CHUNK,
        # The reference leaves a chunk's logprobs optional; Tollway's always carry them.
        "choices[]": ("index", "delta", "logprobs", "finish_reason"),
        **_CHAT_LOGPROBS,
        "usage": _USAGE,
    },
    "completion": {"": _ANSWER, **_COMPLETION_CHOICES, "usage": _USAGE},
    # A streamed completion's chunks have the whole answer's shape, usage aside.
    "completion_chunk": {"": _CHUNK, **_COMPLETION_CHOICES, "usage": _USAGE},
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


def kind_of(answer: Mapping[str, Any], *, is_chunk: bool) -> Kind:
    """The kind ``answer``'s ``object`` names; raises ``AssertionError`` for one that is not
    an answer's (a chunk's object in a whole answer included)."""
    kind = KIND_BY_OBJECT.get((str(answer.get("object")), is_chunk))
    assert kind is not None, f"not an answer's object ({is_chunk=}): {answer}"
    return kind


def check_answer(answer: Mapping[str, Any], kind: Kind) -> BaseModel:
    """``answer`` as the SDK's type for ``kind``; raises ``AssertionError`` naming the
    required fields it lacks (or a ``system_fingerprint`` not ``fp_...``, a chunk with both
    choices and usage), pydantic's ``ValidationError`` for a field of the wrong type."""
    missing = missing_required(answer, kind)
    assert not missing, f"{kind} lacks OpenAI's required {missing}: {answer}"
    fingerprint = answer["system_fingerprint"]
    is_fingerprint = isinstance(fingerprint, str) and fingerprint.startswith("fp_")
    assert is_fingerprint, f"system_fingerprint is not fp_...: {answer}"
    if kind in CHUNK_KINDS and answer["choices"]:
        assert answer.get("usage") is None, f"usage only in a chunk without choices: {answer}"
    return _SDK_TYPES[kind].model_validate(_as_sdk_reads_it(answer, kind))


def _as_sdk_reads_it(answer: Mapping[str, Any], kind: Kind) -> dict[str, Any]:
    """``answer`` with the values OpenAI's API (or Tollway, as an extension) sends but the
    SDK's generated types, which the SDK builds without validating, do not allow, each
    replaced by one they do; anything else is left for the type to check:

    - a streamed text completion's ``finish_reason`` is null until its last chunk (the SDK
      reads those chunks as ``Completion``s);
    - an echoed prompt's first token has no logprob: null in ``token_logprobs`` and
      ``top_logprobs``, both, and only as a text completion choice's first entry (where a
      whole answer's logprobs, or a choice's first chunk's, start);
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
        is_completion = kind in ("completion", "completion_chunk")
        if is_completion and isinstance(logprobs, dict) and _opens_with_echo(logprobs):
            choice["logprobs"] = {
                **logprobs,
                "token_logprobs": [0.0, *logprobs["token_logprobs"][1:]],
                "top_logprobs": [{}, *logprobs["top_logprobs"][1:]],
            }
        read.append(choice)
    return {**answer, "choices": read}


def _opens_with_echo(logprobs: Mapping[str, Any]) -> bool:
    """Whether legacy ``logprobs`` start with an echoed prompt's first token: null in both
    ``token_logprobs`` and ``top_logprobs``."""
    values, top = logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
    return (
        isinstance(values, list)
        and isinstance(top, list)
        and bool(values and top)
        and values[0] is None
        and top[0] is None
    )


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
