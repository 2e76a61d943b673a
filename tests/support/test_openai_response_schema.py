"""The checks the response-schema helper took over from the engine server tests' own copy:
a chat chunk's logprobs and their top alternatives, a streamed completion's legacy logprobs,
a whole answer's usage, no usage beside choices, an ``fp_`` fingerprint, the echoed prompt's
null logprob only where it opens a choice's logprobs, and an answer's kind by its object.
(``tests/gateway/request_path/test_response_schema.py`` has the rest.)
"""

from __future__ import annotations

import copy
from typing import Any

import pydantic
import pytest

from tests.support.openai_response_schema import Kind, check_answer, kind_of, missing_required

HEAD: dict[str, Any] = {
    "id": "x-1",
    "created": 1,
    "model": "m",
    "system_fingerprint": "fp_0123456789",
}
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
TOKEN = {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}
CHAT_CHUNK: dict[str, Any] = {
    **HEAD,
    "object": "chat.completion.chunk",
    "choices": [
        {
            "index": 0,
            "delta": {"content": "Hi"},
            "logprobs": {"content": [{**TOKEN, "top_logprobs": [TOKEN]}], "refusal": None},
            "finish_reason": None,
        }
    ],
}
LOGPROBS = {
    "tokens": ["Once", " upon"],
    "token_logprobs": [None, -1.5],
    "top_logprobs": [None, {" upon": -1.5}],
    "text_offset": [0, 4],
}
COMPLETION: dict[str, Any] = {
    **HEAD,
    "object": "text_completion",
    "choices": [{"index": 0, "text": "Once upon", "logprobs": LOGPROBS, "finish_reason": "length"}],
    "usage": USAGE,
}


def edited(answer: dict[str, Any], path: tuple[str | int, ...], value: Any = ...) -> Any:
    """A copy of ``answer`` with the field at ``path`` set to ``value`` (``...``: removed)."""
    copied = copy.deepcopy(answer)
    parent: Any = copied
    for step in path[:-1]:
        parent = parent[step]
    if value is ...:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return copied


@pytest.mark.parametrize(
    ("answer", "kind", "path", "missing"),
    [
        (CHAT_CHUNK, "chat_chunk", ("choices", 0, "logprobs"), "choices[0].logprobs"),
        (
            CHAT_CHUNK,
            "chat_chunk",
            ("choices", 0, "logprobs", "refusal"),
            "choices[0].logprobs.refusal",
        ),
        (
            CHAT_CHUNK,
            "chat_chunk",
            ("choices", 0, "logprobs", "content", 0, "top_logprobs", 0, "bytes"),
            "choices[0].logprobs.content[0].top_logprobs[0].bytes",
        ),
        (
            {**COMPLETION, "usage": None},
            "completion_chunk",
            ("choices", 0, "logprobs", "text_offset"),
            "choices[0].logprobs.text_offset",
        ),
        (COMPLETION, "completion", ("usage",), "usage"),
        (COMPLETION, "completion", ("system_fingerprint",), "system_fingerprint"),
    ],
)
def test_a_missing_field_is_named(
    answer: dict[str, Any], kind: Kind, path: tuple[str | int, ...], missing: str
) -> None:
    check_answer(answer, kind)
    assert missing_required(edited(answer, path), kind) == [missing]
    with pytest.raises(AssertionError, match=missing.replace("[", r"\[").replace("]", r"\]")):
        check_answer(edited(answer, path), kind)


def test_a_chunk_leaves_usage_to_the_last_one_without_choices() -> None:
    check_answer({**CHAT_CHUNK, "usage": None}, "chat_chunk")
    check_answer({**CHAT_CHUNK, "choices": [], "usage": USAGE}, "chat_chunk")
    check_answer(COMPLETION, "completion")  # a whole answer has both
    chunks: list[tuple[Kind, dict[str, Any]]] = [
        ("chat_chunk", CHAT_CHUNK),
        ("completion_chunk", COMPLETION),
    ]
    for kind, chunk in chunks:
        with pytest.raises(AssertionError, match="usage only in a chunk without choices"):
            check_answer({**chunk, "usage": USAGE}, kind)


@pytest.mark.parametrize("fingerprint", [None, "", "0123456789", 7])
def test_the_system_fingerprint_is_an_fp_string(fingerprint: Any) -> None:
    with pytest.raises(AssertionError):
        check_answer({**COMPLETION, "system_fingerprint": fingerprint}, "completion")


@pytest.mark.parametrize(
    ("token_logprobs", "top_logprobs"),
    [
        ([-0.5, None], [{"Once": -0.5}, None]),  # not the first entry
        ([None, -1.5], [{"Once": -0.5}, {" upon": -1.5}]),  # a logprob but no top
        ([-0.5, -1.5], [None, {" upon": -1.5}]),  # top null, the logprob not
    ],
)
def test_a_null_logprob_passes_only_as_an_echoed_prompts_first(
    token_logprobs: list[Any], top_logprobs: list[Any]
) -> None:
    check_answer(COMPLETION, "completion")
    logprobs = {**LOGPROBS, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs}
    with pytest.raises(pydantic.ValidationError):
        check_answer(edited(COMPLETION, ("choices", 0, "logprobs"), logprobs), "completion")


def test_the_kind_is_the_one_the_object_names() -> None:
    assert kind_of(CHAT_CHUNK, is_chunk=True) == "chat_chunk"
    assert kind_of(COMPLETION, is_chunk=False) == "completion"
    assert kind_of(COMPLETION, is_chunk=True) == "completion_chunk"
    assert kind_of({"object": "chat.completion"}, is_chunk=False) == "chat"
    for obj, is_chunk in [("chat.completion.chunk", False), ("chat.completion", True), ("x", 0)]:
        with pytest.raises(AssertionError, match="not an answer's object"):
            kind_of({"object": obj}, is_chunk=bool(is_chunk))
