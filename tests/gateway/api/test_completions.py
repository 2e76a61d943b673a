"""The completion endpoints' own pieces; the request path end to end is in request_path/."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.api.completions import AnswerThenSettle

SCOPE: dict[str, Any] = {"type": "http", "method": "POST", "path": "/v1/completions"}


async def receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


@pytest.mark.parametrize("fails_at", [None, "http.response.start", "http.response.body"])
async def test_an_answer_is_settled_once_however_sending_ends(fails_at: str | None) -> None:
    settled: list[str] = []
    sent: list[str] = []

    async def settle() -> None:
        settled.append("settled")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == fails_at:
            raise OSError("the client is gone")
        sent.append(message["type"])

    answer = AnswerThenSettle(b'{"id": "x"}', {"x-request-id": "r"}, settle)
    if fails_at is None:
        await answer(SCOPE, receive, send)
        assert sent == ["http.response.start", "http.response.body"]
    else:
        with pytest.raises(OSError):
            await answer(SCOPE, receive, send)
    assert settled == ["settled"]
