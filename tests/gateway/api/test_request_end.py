"""How a forwarded request ends: one usage record, the stream closed first, one settle;
and a JSON answer settled once however sending ends. The request path end to end is in
request_path/."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import httpx
import pytest

from gateway.accounting.settlement import Accountant, AnswerNotRecorded, RequestInfo
from gateway.admission.outcomes import Admission, Refusal
from gateway.api.request_end import AnswerThenSettle, RequestEnd
from gateway.errors import ApiError
from gateway.ledger.budget_ledger import Charge
from gateway.storage.models import UsageStatus
from gateway.upstream.pool import UpstreamCall
from gateway.upstream.stream_relay import UsageMeter
from openai_protocol.errors import INVALID_REQUEST
from policies.decision import Rejection

SCOPE: dict[str, Any] = {"type": "http", "method": "POST", "path": "/v1/completions"}
ADMISSION = Admission(
    served_model="m",
    version="m",
    route=None,
    prompt_tokens=7,
    max_tokens=16,
    priority="interactive",
    reservation=None,
)
INFO = cast(RequestInfo, object())  # only handed on to the accountant


class RecordingAccountant:
    """What an `Accountant` was asked, in order; each record settles to 7 + 3 tokens."""

    def __init__(self, refusal: AnswerNotRecorded | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.refusal = refusal  # raised by record: the usage writer did not take it
        self.writing = asyncio.Event()  # set: records go through (cleared: they wait)
        self.writing.set()

    async def record(
        self, info: RequestInfo, admission: Admission, meter: UsageMeter, *, was_answered: bool
    ) -> Charge:
        status = meter.status if meter.is_finished else UsageStatus.CANCELLED
        self.calls.append(("record", status, was_answered))
        await self.writing.wait()
        if self.refusal is not None:
            raise self.refusal
        return Charge(10, 30) if was_answered else Charge(0)

    def reject(self, info: RequestInfo, refusal: Refusal) -> None:
        self.calls.append(("reject", refusal.rejection.code, refusal.served_model))

    async def settle(
        self, admission: Admission, charge: Charge, info: RequestInfo | None = None
    ) -> None:
        self.calls.append(("settle", charge.tokens))


def request_end(
    refusal: AnswerNotRecorded | None = None,
) -> tuple[RequestEnd, RecordingAccountant]:
    accountant = RecordingAccountant(refusal)
    end = RequestEnd(cast(Accountant, accountant), INFO, ADMISSION, UsageMeter())
    return end, accountant


class Stream(httpx.AsyncByteStream):
    def __init__(self, calls: list[tuple[Any, ...]], *, fails: bool = False) -> None:
        self.calls, self.fails = calls, fails

    async def aclose(self) -> None:
        self.calls.append(("closed",))
        if self.fails:
            raise httpx.ReadError("the engine's connection broke")


async def test_recorded_before_the_end_is_recorded_once_and_settled_once() -> None:
    end, accountant = request_end()
    await end.record(UsageStatus.COMPLETED)
    await end.record(UsageStatus.UPSTREAM_ERROR)  # e.g. the relay's end, then the close
    await end.finish()
    await end.finish(UsageStatus.UPSTREAM_ERROR, was_answered=False)
    assert accountant.calls == [("record", UsageStatus.COMPLETED, True), ("settle", 10)]


async def test_a_stream_cut_short_is_closed_then_recorded_as_the_meter_stands() -> None:
    end, accountant = request_end()
    call = UpstreamCall(httpx.Response(200, stream=Stream(accountant.calls)), "http://a")
    await end.finish(closing=call)
    assert accountant.calls == [
        ("closed",),
        ("record", UsageStatus.CANCELLED, True),
        ("settle", 10),
    ]


async def test_a_close_that_fails_still_records_and_settles() -> None:
    end, accountant = request_end()
    call = UpstreamCall(httpx.Response(200, stream=Stream(accountant.calls, fails=True)), "a")
    with pytest.raises(httpx.ReadError):
        await end.finish(UsageStatus.UPSTREAM_ERROR, closing=call)
    assert accountant.calls[1:] == [("record", UsageStatus.UPSTREAM_ERROR, True), ("settle", 10)]


async def test_an_engine_refusal_is_its_one_record_and_releases_the_reservation() -> None:
    end, accountant = request_end()
    end.reject(Rejection.of(INVALID_REQUEST, "too long"))
    await end.record(UsageStatus.UPSTREAM_ERROR, was_answered=False)
    await end.finish()
    assert accountant.calls == [("reject", INVALID_REQUEST.code, "m"), ("settle", 0)]


@pytest.mark.parametrize("num_tokens_kept", [0, 10])
async def test_an_answer_whose_record_was_not_accepted_is_a_503_settled_to_what_was_kept(
    num_tokens_kept: int,
) -> None:
    end, accountant = request_end(AnswerNotRecorded("req-1", Charge(num_tokens_kept)))
    with pytest.raises(ApiError) as refused:
        await end.record(UsageStatus.COMPLETED)
    assert refused.value.rejection.status == 503
    assert refused.value.rejection.code == "usage_records_unavailable"
    assert refused.value.rejection.headers["Retry-After"]
    assert accountant.calls[-1] == ("settle", num_tokens_kept)  # before the 503 is answered
    await end.finish()  # the close: nothing written or settled again
    assert accountant.calls == [
        ("record", UsageStatus.COMPLETED, True),
        ("settle", num_tokens_kept),
    ]


async def test_a_close_during_the_record_waits_for_it_and_settles_to_what_it_wrote() -> None:
    end, accountant = request_end()
    accountant.writing.clear()  # the record waits for its fsync
    relay_end = asyncio.ensure_future(end.record(UsageStatus.COMPLETED))
    await asyncio.sleep(0)
    relay_end.cancel()  # the client left while the record was being written
    closing = asyncio.ensure_future(end.finish())
    await asyncio.sleep(0)
    accountant.writing.set()
    await closing
    with pytest.raises(asyncio.CancelledError):
        await relay_end
    assert accountant.calls == [("record", UsageStatus.COMPLETED, True), ("settle", 10)]


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
        with pytest.raises(OSError, match="the client is gone"):
            await answer(SCOPE, receive, send)
    assert settled == ["settled"]
