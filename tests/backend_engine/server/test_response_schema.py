"""The engine server tests' check of an answer: the kind its object names, chunk or not, and
an error event skipped; the check itself is `tests.support.openai_response_schema`'s."""

from __future__ import annotations

from typing import Any

import pytest

from tests.backend_engine.server.response_schema import check_answer

CHUNK: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "m",
    "system_fingerprint": "fp_0123456789",
    "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}],
}


def test_a_chunk_is_checked_as_one_and_only_as_one() -> None:
    check_answer(CHUNK, is_chunk=True)
    with pytest.raises(AssertionError, match="not an answer's object"):
        check_answer(CHUNK)
    without_logprobs = {**CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    with pytest.raises(AssertionError, match=r"choices\[0\]\.logprobs"):
        check_answer(without_logprobs, is_chunk=True)


def test_an_error_event_is_not_an_answer() -> None:
    check_answer({"error": {"message": "engine failed", "type": "server_error"}}, is_chunk=True)
