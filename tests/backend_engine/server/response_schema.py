"""Every chat and text completion the engine server's tests receive, whole or streamed, is
checked here: against the openai SDK's response types, and for the fields OpenAI's API
reference marks as required (the SDK's types leave some optional: ``message.refusal``,
``system_fingerprint``...). A key must be present; its value may be null where the
reference allows it.

Two Tollway extensions are let through, each narrowly: ``finish_reason`` ``"abort"`` (a
request stopped by ``POST /abort_request``) and ``"error"`` (it failed in the engine). So are
two places where OpenAI's API sends what the SDK's generated types (which the SDK builds
without validating) do not allow: a text completion chunk's null ``finish_reason`` before its
last, and an echoed prompt's first token's null logprob.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

JSON = dict[str, Any]

EXTENSION_FINISH_REASONS = {"abort", "error"}

# OpenAI's API reference: the required fields of each object, by dotted path ("[]": each
# item of a list).
REQUIRED = {
    "chat.completion": [
        "id",
        "object",
        "created",
        "model",
        "system_fingerprint",
        "choices",
        "choices[].index",
        "choices[].message",
        "choices[].message.role",
        "choices[].message.content",
        "choices[].message.refusal",
        "choices[].logprobs",
        "choices[].logprobs.content",
        "choices[].logprobs.refusal",
        "choices[].finish_reason",
        "usage",
        "usage.prompt_tokens",
        "usage.completion_tokens",
        "usage.total_tokens",
    ],
    "chat.completion.chunk": [
        "id",
        "object",
        "created",
        "model",
        "system_fingerprint",
        "choices",
        "choices[].index",
        "choices[].delta",
        "choices[].logprobs",
        "choices[].logprobs.content",
        "choices[].logprobs.refusal",
        "choices[].finish_reason",
    ],
    "text_completion": [
        "id",
        "object",
        "created",
        "model",
        "system_fingerprint",
        "choices",
        "choices[].index",
        "choices[].text",
        "choices[].logprobs",
        "choices[].finish_reason",
    ],
}


def missing_fields(obj: JSON, paths: list[str]) -> list[str]:
    """The ``paths`` absent from ``obj`` (a path under a null value is not required)."""
    missing = []
    for path in paths:
        values: list[Any] = [obj]
        for part in path.split("."):
            name, is_each = part.removesuffix("[]"), part.endswith("[]")
            found: list[Any] = []
            for value in values:
                if value is None:
                    continue
                if name not in value:
                    missing.append(path)
                    continue
                found.extend(value[name] if is_each else [value[name]])
            values = found
    return sorted(set(missing))


def _as_sdk_would_accept(answer: JSON, *, is_chunk: bool) -> JSON:
    """The answer with the values above replaced by ones the SDK's types take."""
    answer = copy.deepcopy(answer)
    for choice in answer.get("choices", []):
        if choice.get("finish_reason") in EXTENSION_FINISH_REASONS:
            choice["finish_reason"] = "stop"
        if is_chunk and answer["object"] == "text_completion" and choice["finish_reason"] is None:
            choice["finish_reason"] = "stop"
        logprobs = choice.get("logprobs")
        if answer["object"] == "text_completion" and logprobs is not None:
            token_logprobs, top = logprobs["token_logprobs"], logprobs["top_logprobs"]
            # Only an echoed prompt's first token, which opens a choice's logprobs.
            if token_logprobs and token_logprobs[0] is None:
                assert top[0] is None
                token_logprobs[0], top[0] = 0.0, {}
    return answer


def check_answer(answer: JSON, *, is_chunk: bool = False) -> None:
    """A whole answer or a stream chunk of either endpoint (an error event is not one)."""
    if "error" in answer:
        return
    kind = answer["object"]
    assert is_chunk == (kind == "chat.completion.chunk") or kind == "text_completion"
    missing = missing_fields(answer, REQUIRED[kind])
    assert not missing, (missing, answer)
    assert answer["system_fingerprint"].startswith("fp_")
    accepted = _as_sdk_would_accept(answer, is_chunk=is_chunk)
    if kind == "chat.completion":
        ChatCompletion.model_validate(accepted)
    elif kind == "chat.completion.chunk":
        ChatCompletionChunk.model_validate(accepted)
        if answer["choices"]:
            assert "usage" not in answer or answer["usage"] is None
    else:
        Completion.model_validate(accepted)
        if "usage" in answer and answer["usage"] is not None:
            assert set(answer["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens"}


def check_response(response: httpx.Response) -> None:
    """An httpx response hook: a non-streamed 200 answer of either endpoint is checked
    (streams are checked chunk by chunk where their events are read)."""
    path = response.request.url.path
    is_generation = path.endswith(("/chat/completions", "/completions"))
    content_type = response.headers.get("content-type", "")
    if is_generation and response.status_code == 200 and content_type == "application/json":
        response.read()
        check_answer(json.loads(response.content))


def checked_client(base_url: str, **kwargs: Any) -> httpx.Client:
    """An httpx client whose every non-streamed answer is checked."""
    return httpx.Client(base_url=base_url, event_hooks={"response": [check_response]}, **kwargs)
