"""Reading an engine's server-sent events from raw bytes, however the network cuts them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.upstream.sse_reader import sse_batches

STREAM = (
    b'data: {"a": 1}\n\n'
    b": a comment, then an event without data\n\nevent: ping\n\n"
    b"data: first line\ndata:second line\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = ['{"a": 1}', "first line\nsecond line", "[DONE]"]


class Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


async def batches(chunks: list[bytes]) -> list[list[str]]:
    response = httpx.Response(200, stream=Chunks(chunks))
    return [batch async for batch in sse_batches(response)]


async def events(chunks: list[bytes]) -> list[str]:
    return [data for batch in await batches(chunks) for data in batch]


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
async def test_every_line_ending_and_every_cut(newline: bytes) -> None:
    stream = STREAM.replace(b"\n", newline)
    assert await events([stream]) == EXPECTED
    for cut in range(1, len(stream)):
        assert await events([stream[:cut], stream[cut:]]) == EXPECTED, cut
    assert await events([bytes([b]) for b in stream]) == EXPECTED


async def test_a_last_event_without_its_blank_line_still_counts() -> None:
    assert await events([b"data: x\n\ndata: tail"]) == ["x", "tail"]
    assert await events([b"data: caf\xc3", b"\xa9\n\n"]) == ["café"]


async def test_events_that_arrive_together_stay_together() -> None:
    assert await batches([STREAM]) == [EXPECTED]
    assert await batches([b"data: a\n\ndata: b", b"\n\ndata: c\n\n", b": ping\n\n"]) == [
        ["a"],
        ["b", "c"],
    ]  # a read that completes no event (half of one, or a comment) yields nothing
