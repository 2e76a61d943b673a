"""The pool: asking engines to stop a request; the replica order's hook around each attempt."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import pytest

from gateway.settings import ModelSettings
from gateway.upstream.pool import UpstreamPool


def pool_of(answers: dict[str, Callable[[httpx.Request], httpx.Response]]) -> UpstreamPool:
    """A pool whose model ``m`` has one replica per entry of ``answers`` (by host)."""
    models = {"m": ModelSettings("m", tuple(f"http://{host}" for host in answers), 4096)}

    def handler(request: httpx.Request) -> httpx.Response:
        return answers[request.url.host](request)

    return UpstreamPool(models, transport_factory=lambda _uds: httpx.MockTransport(handler))


def aborted(value: object) -> Callable[[httpx.Request], httpx.Response]:
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.method == "POST"
        assert request.url.path == "/abort_request"
        assert json.loads(request.content) == {"request_id": "req_1"}
        return httpx.Response(200, json={"aborted": value})

    return answer


def refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("refused", request=request)


async def test_stop_asks_every_replica_and_reports_whether_one_had_the_request() -> None:
    pool = pool_of({"a": aborted(False), "b": aborted(True)})
    assert await pool.stop("m", "req_1") is True
    pool = pool_of({"a": aborted(False), "b": aborted(False)})
    assert await pool.stop("m", "req_1") is False


@pytest.mark.parametrize(
    "answer",
    [
        refused,
        lambda request: httpx.Response(404, json={"detail": "Not Found"}),  # not our engine
        lambda request: httpx.Response(200, content=b"not json"),
        lambda request: httpx.Response(200, json=["aborted"]),
        aborted("yes"),
    ],
)
async def test_stop_is_false_for_engines_that_cannot_stop_and_for_failures(
    answer: Callable[[httpx.Request], httpx.Response],
) -> None:
    assert await pool_of({"a": answer}).stop("m", "req_1") is False
    assert await pool_of({"a": answer, "b": aborted(True)}).stop("m", "req_1") is True


class RecordingOrder:
    """A `ReplicaOrder` that answers a fixed order and records what the pool tells it."""

    def __init__(self, order: list[str]) -> None:
        self._order = order
        self.events: list[tuple[str, ...]] = []
        self.prompt_token_ids: Sequence[int] | None = None

    async def order(
        self,
        model: str,
        replicas: list[str],
        body: Mapping[str, Any],
        prompt_token_ids: Sequence[int] | None = None,
    ) -> list[str]:
        self.events.append(("order", model, *sorted(replicas)))
        self.prompt_token_ids = prompt_token_ids
        return self._order

    def sent(self, replica: str) -> None:
        self.events.append(("sent", replica))

    def finished(self, replica: str) -> None:
        self.events.append(("finished", replica))


async def test_the_replica_order_hook_orders_attempts_and_sees_each_one_in_flight() -> None:
    sse = b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n'
    pool = pool_of(
        {
            "a": lambda _: httpx.Response(503),
            "b": lambda _: httpx.Response(200, content=sse),
            "c": lambda _: httpx.Response(200, json={"choices": []}),
        }
    )
    hook = RecordingOrder(["http://c", "http://a", "http://b"])
    pool.replica_order = hook
    body = {"model": "m", "prompt": "hi"}
    call = await pool.open("m", "/v1/completions", body, {}, is_stream=False)
    assert call.replica == "http://c"
    assert hook.events == [
        ("order", "m", "http://a", "http://b", "http://c"),
        ("sent", "http://c"),
        ("finished", "http://c"),  # a whole answer: done once read
    ]
    hook.events.clear()
    hook._order = ["http://a", "http://b"]
    call = await pool.open(
        "m", "/v1/completions", body, {}, is_stream=True, prompt_token_ids=[1, 9, 4]
    )
    assert hook.prompt_token_ids == [1, 9, 4]  # the admitter's ids, handed on
    assert (call.replica, call.num_failed_replicas) == ("http://b", 1)
    assert hook.events[1:] == [("sent", "http://a"), ("finished", "http://a"), ("sent", "http://b")]
    await call.aclose()  # a stream is in flight until the relay closes it
    await call.aclose()
    assert hook.events[-1] == ("finished", "http://b")
    assert len(hook.events) == 5
    await pool.aclose()


ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}
CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
TOOL_CALL = {"choices": [{"index": 0, "delta": {"content": None, "tool_calls": [CALL]}}]}


def sse(*chunks: object) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)


@pytest.mark.parametrize(
    ("broken_stream", "replica"),
    [
        (sse(ROLE), "http://b"),  # no token yet: tried elsewhere
        (sse(ROLE, TOOL_CALL), "http://a"),  # a tool call's first piece is a first token
    ],
)
async def test_a_stream_stays_on_its_replica_once_a_tool_call_has_begun(
    broken_stream: bytes, replica: str
) -> None:
    """A stream that breaks (no ``[DONE]``) is retried on the next replica only before its
    first token; a tool call's delta (``content`` null) is one, as content is."""
    pool = pool_of(
        {
            "a": lambda _: httpx.Response(200, content=broken_stream),
            "b": lambda _: httpx.Response(200, content=sse(ROLE, TOOL_CALL) + b"data: [DONE]\n\n"),
        }
    )
    pool.replica_order = RecordingOrder(["http://a", "http://b"])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    call = await pool.open("m", "/v1/chat/completions", body, {}, is_stream=True)
    assert call.replica == replica
    await call.aclose()
    await pool.aclose()
