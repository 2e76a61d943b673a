"""How a forwarded request ends, written once for every kind of answer.

    answer kind                 record (one per request)          then, once
    engine's error, 5xx         "upstream_error", nothing charged  reservation released
    engine's refusal, 4xx       "rejected", the engine's code      reservation released
    no engine answered (503)    "upstream_error", nothing charged  reservation released
    JSON                        before the JSON is sent            settled after it is sent
    stream                      before [DONE] is sent, or at the   upstream call closed,
                                close if cut short (client gone,   then settled
                                engine failed): what was relayed
    client gone before a JSON   at the end: "cancelled", what the  settled
    answer                      engine generated

Recording before the last bytes makes the record durable (fsynced in the usage writer's
spill file, or in the database) before the client has its whole answer: a gateway killed
after that loses no record. Settling after them never delays the answer. A record that
neither could take turns the answer into a 503 ``usage_records_unavailable`` (a stream: an
error event before ``[DONE]``), settled at once to what is recorded (`AnswerNotRecorded.charge`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.accounting.settlement import Accountant, AnswerNotRecorded, RequestInfo
from gateway.admission.outcomes import Admission, Refusal
from gateway.errors import ApiError, usage_records_unavailable
from gateway.ledger.budget_ledger import Charge
from gateway.storage.models import UsageStatus
from gateway.upstream.pool import UpstreamCall
from gateway.upstream.stream_relay import UsageMeter
from openai_protocol.disconnect import run_to_end
from policies.decision import Rejection


class RequestEnd:
    """The end of one forwarded request, written once: its one usage record, the upstream
    call closed (an open stream), its reservation settled.

    `record` writes the record the first time it is called and does nothing after, so an
    answer is recorded before its last bytes are sent and `finish` (after them, however
    sending ended) only closes and settles; where nothing recorded it first (client gone,
    engine failed mid-stream) `finish` records, after closing the stream, what the meter
    holds then. `reject` records the engine's refusal instead. `finish` settles once.
    """

    __slots__ = (
        "_accountant",
        "_charge",
        "_is_settled",
        "_recording",
        "_refusal",
        "admission",
        "info",
        "meter",
    )

    def __init__(
        self, accountant: Accountant, info: RequestInfo, admission: Admission, meter: UsageMeter
    ) -> None:
        self._accountant = accountant
        self.info = info
        self.admission = admission
        self.meter = meter
        self._charge: Charge | None = None  # what the reservation settles to, once recorded
        self._is_settled = False
        self._recording: asyncio.Task[None] | None = None
        self._refusal: AnswerNotRecorded | None = None  # the record was not accepted

    async def record(
        self, outcome: UsageStatus | None = None, *, was_answered: bool = True
    ) -> None:
        """Write the usage record unless it is written: ``outcome`` finishes the meter if it
        is not (a meter still unfinished records as cancelled); ``was_answered``: an engine
        accepted the request, so its tokens count. Raises the 503 `ApiError`
        (``usage_records_unavailable``) when the record was not accepted, after settling the
        reservation to what was recorded: the caller answers that instead."""
        if self._recording is not None or self._charge is not None:
            if self._recording is not None:  # another call's write: wait for its end
                await run_to_end(self._recording)
            return
        if outcome is not None:
            self.meter.finish(outcome)
        # A task, run to its end even if this request is cancelled meanwhile (the client
        # gone): what the reservation settles to must be what the writer took, and a second
        # call (`finish`, after a cancel) waits for it instead of writing again.
        self._recording = asyncio.ensure_future(self._write(was_answered))
        await run_to_end(self._recording)
        if self._refusal is not None:
            raise usage_records_unavailable() from self._refusal

    async def _write(self, was_answered: bool) -> None:
        try:
            self._charge = await self._accountant.record(
                self.info, self.admission, self.meter, was_answered=was_answered
            )
        except AnswerNotRecorded as exc:
            self._charge = exc.charge
            self._refusal = exc
            await self._settle()

    def reject(self, rejection: Rejection) -> None:
        """Record the engine's refusal of the request as a refusal at the door (its code);
        the reservation is then released."""
        if self._charge is not None:
            return
        admission = self.admission
        refusal = Refusal(
            rejection,
            admission.served_model,
            admission.route,
            admission.prompt_tokens,
            admission.version,
        )
        self._accountant.reject(self.info, refusal)
        self._charge = Charge(0)

    async def finish(
        self,
        outcome: UsageStatus | None = None,
        *,
        was_answered: bool = True,
        closing: UpstreamCall | None = None,
    ) -> None:
        """Close ``closing`` (the engine aborts what it still generates), `record` unless
        recorded (even if closing failed), and settle the reservation to the recorded
        tokens (once)."""
        try:
            if closing is not None:
                await closing.aclose()
        finally:
            with contextlib.suppress(ApiError):  # nobody to answer: counted, logged, settled
                await self.record(outcome, was_answered=was_answered)
            await self._settle()

    async def _settle(self) -> None:
        if not self._is_settled and self._charge is not None:
            self._is_settled = True
            await self._accountant.settle(self.admission, self._charge, self.info)


class AnswerThenSettle(Response):
    """A JSON answer whose reservation is settled after it is sent, however sending ends:
    Starlette's background task would be skipped if ``send`` raised (the client gone), and
    the reservation would then lapse unsettled."""

    def __init__(
        self, body: bytes, headers: dict[str, str], settle: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(body, headers=headers, media_type="application/json")
        self._settle = settle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except BaseException:
            await run_to_end(self._settle())
            raise
        await self._settle()
