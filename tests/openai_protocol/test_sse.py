"""EventStreamResponse: every exit path sends what it should and runs the clean-up once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest
from starlette.types import Message, Scope

from openai_protocol.sse import EventStreamResponse

SCOPE: Scope = {"type": "http"}


class Events:
    """An async iterator of SSE chunks that records being closed; ``gate`` (if set) is
    awaited before each chunk after the first."""

    def __init__(
        self, chunks: list[str], gate: asyncio.Event | None = None, fail_at: int = -1
    ) -> None:
        self.chunks, self.gate, self.fail_at = chunks, gate, fail_at
        self.num_closed = 0
        self._iterator = self._generate()

    async def _generate(self) -> AsyncGenerator[str, None]:
        for i, chunk in enumerate(self.chunks):
            if i == self.fail_at:
                raise RuntimeError("engine broke")
            if i > 0 and self.gate is not None:
                await self.gate.wait()
            yield chunk

    def __aiter__(self) -> Events:
        return self

    async def __anext__(self) -> str:
        return await self._iterator.__anext__()

    async def aclose(self) -> None:
        self.num_closed += 1
        await self._iterator.aclose()


class Client:
    """The server side of one connection: ``receive`` reports a disconnect when told to,
    or (as uvicorn does) once the response is complete."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.leave = asyncio.Event()

    async def receive(self) -> Message:
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message["more_body"]:
            self.leave.set()

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


def response(events: Events, closes: list[str]) -> EventStreamResponse:
    async def on_close() -> None:
        await asyncio.sleep(0)  # an await that a cancellation could interrupt
        closes.append("closed")

    return EventStreamResponse(events, on_close=on_close, headers={"x-request-id": "req_1"})


async def test_sends_every_event_then_ends_the_body_and_cleans_up_once() -> None:
    events, client = Events(["data: 1\n\n", "data: 2\n\n"]), Client()
    closes: list[str] = []
    await response(events, closes)(SCOPE, client.receive, client.send)
    start = client.sent[0]
    assert start["type"] == "http.response.start"
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"x-request-id"] == b"req_1"
    assert client.bodies == [b"data: 1\n\n", b"data: 2\n\n", b""]
    assert closes == ["closed"]
    assert events.num_closed == 1


async def test_a_client_that_leaves_stops_the_stream_without_an_error() -> None:
    gate = asyncio.Event()  # never set: the stream waits for its second event
    events, client = Events(["data: 1\n\n", "data: 2\n\n"], gate), Client()
    closes: list[str] = []
    task = asyncio.create_task(response(events, closes)(SCOPE, client.receive, client.send))
    while not client.bodies:  # noqa: ASYNC110 (yields to the response)
        await asyncio.sleep(0)
    client.leave.set()
    await asyncio.wait_for(task, timeout=5)  # returns normally: leaving is not an error
    assert client.bodies == [b"data: 1\n\n"]
    assert closes == ["closed"]
    assert events.num_closed == 1
    if hasattr(task, "cancelling"):  # Python 3.11+: the response undid its own cancel
        assert task.cancelling() == 0


async def test_an_error_in_the_events_propagates_after_the_clean_up() -> None:
    events, client = Events(["data: 1\n\n", "data: 2\n\n"], fail_at=1), Client()
    closes: list[str] = []
    with pytest.raises(RuntimeError, match="engine broke"):
        await response(events, closes)(SCOPE, client.receive, client.send)
    assert client.bodies == [b"data: 1\n\n"]
    assert closes == ["closed"]


async def test_cancelled_from_outside_it_cleans_up_to_the_end_then_is_cancelled() -> None:
    gate = asyncio.Event()
    events, client = Events(["data: 1\n\n", "data: 2\n\n"], gate), Client()
    closes: list[str] = []
    task = asyncio.create_task(response(events, closes)(SCOPE, client.receive, client.send))
    while not client.bodies:  # noqa: ASYNC110 (yields to the response)
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    task.cancel()  # a second cancellation lands during the clean-up
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closes == ["closed"]
    assert events.num_closed == 1


async def test_the_disconnect_after_a_complete_response_does_not_cancel_the_clean_up() -> None:
    events, client = Events(["data: 1\n\n"]), Client()
    closes: list[str] = []
    task = asyncio.create_task(response(events, closes)(SCOPE, client.receive, client.send))
    await asyncio.wait_for(task, timeout=5)
    assert not task.cancelled()
    assert closes == ["closed"]
