"""The end of every request: write its one usage record, count it, settle its reservation.

Exactly one of `Accountant.reject` / `Accountant.record` runs per authenticated request; a
recorded request's reservation is then settled (`settle`; `finish` does both). An answered
request is recorded before the last bytes of its answer are sent and settled after, so a
gateway killed once the client has its whole answer loses no record.

When a reservation is settled, and to what::

    engine usage arrived (completed, or it came before the end)  -> prompt + completion (engine)
    stream stopped early (client gone, engine failed mid-stream) -> prompt + tokens relayed
    engine never answered / refused the request                  -> released: nothing is used

A record's ``prompt_tokens + completion_tokens`` is always exactly what was settled (zero for
rejected and released requests), so summing the records rebuilds the ledger. Its
``finish_reason`` is the last one the engine sent, as the relay measured it ("stop",
"length", "tool_calls"; "abort" for a request the engine was asked to stop); null where none
came: refused, no engine answered, a stream whose client left before its finish chunk.

A settle (or release) that fails because Redis cannot answer never delays the response or
loses the record: it is tried again in the background (``settle_retries``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone

from opentelemetry.trace import Span, Status, StatusCode

from gateway.admission.outcomes import Admission, Refusal
from gateway.auth.bearer_keys import Caller
from gateway.ledger.budget_ledger import BudgetLedger
from gateway.ledger.settle_retries import LedgerRetries
from gateway.observability.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from gateway.storage.models import UsageStatus
from gateway.storage.usage_store import UsageEntry
from gateway.storage.usage_writer import UsageWriter
from gateway.upstream.stream_relay import UsageMeter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestInfo:
    request_id: str
    endpoint: str
    caller: Caller
    requested_model: str
    is_stream: bool
    created_at: datetime
    span: Span


class Accountant:
    def __init__(
        self,
        settings: GatewaySettings,
        ledger: BudgetLedger,
        writer: UsageWriter,
        metrics: GatewayMetrics,
        retries: LedgerRetries | None = None,
    ) -> None:
        self._settings = settings
        self._writer = writer
        self._metrics = metrics
        self._retries = retries if retries is not None else LedgerRetries(ledger)

    def reject(self, info: RequestInfo, refusal: Refusal) -> None:
        reason = refusal.rejection.code
        metrics = self._metrics
        metrics.child(metrics.rejections, reason).inc()
        self._count(
            info, refusal.served_model, refusal.version, f"rejected:{refusal.rejection.status}"
        )
        self._submit(
            info,
            served_model=refusal.served_model,
            model_version=refusal.version,
            route=refusal.route.reason if refusal.route else None,
            status=UsageStatus.REJECTED,
            reject_reason=reason,
        )
        info.span.set_status(Status(StatusCode.ERROR, reason))
        info.span.end()

    async def finish(
        self, info: RequestInfo, admission: Admission, meter: UsageMeter, *, was_answered: bool
    ) -> None:
        """`record`, then `settle`: for requests whose client gets no answer from an engine."""
        await self.settle(admission, self.record(info, admission, meter, was_answered=was_answered))

    def record(
        self, info: RequestInfo, admission: Admission, meter: UsageMeter, *, was_answered: bool
    ) -> int:
        """Write the request's one usage record and count it; returns the tokens its
        reservation settles to. ``was_answered``: an engine accepted the request (so its
        tokens count).

        The record is durable (in the usage writer's spill file) on return, so the request
        path calls this before the last bytes of an answer: a gateway that dies once the
        client has its whole answer has its record. `settle` may come after.
        """
        status = meter.status if meter.is_finished else UsageStatus.CANCELLED
        prompt, cached, completion = meter.tokens(admission.prompt_tokens)
        finish_reason = meter.finish_reason
        if not was_answered:
            prompt = cached = completion = 0
            finish_reason = None
        model, version = admission.served_model, admission.version
        prices = self._settings.models[version].prices  # each version is priced on its own
        metrics = self._metrics
        metrics.child(metrics.tokens, model, version, "input").inc(prompt - cached)
        metrics.child(metrics.tokens, model, version, "cached_input").inc(cached)
        metrics.child(metrics.tokens, model, version, "output").inc(completion)
        self._count(info, model, version, status.value)
        self._submit(
            info,
            served_model=model,
            model_version=version,
            route=admission.route.reason if admission.route else None,
            status=status,
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
            cost_micros=prices.cost_micros(prompt, cached, completion),
            ttft_ms=meter.ttft_ms,
            finish_reason=finish_reason,
        )
        span = info.span
        span.set_attribute("gen_ai.response.model", model)
        span.set_attribute("tollway.model_version", version)
        span.set_attribute("gen_ai.usage.input_tokens", prompt)
        span.set_attribute("gen_ai.usage.output_tokens", completion)
        span.set_attribute("tollway.usage.status", status.value)
        if status is UsageStatus.UPSTREAM_ERROR:
            span.set_status(Status(StatusCode.ERROR, "upstream_error"))
        span.end()
        return prompt + completion

    async def settle(self, admission: Admission, num_tokens: int) -> None:
        """Settle the request's reservation to ``num_tokens`` (`record`'s), or release it."""
        reservation = admission.reservation
        if reservation is None:
            return
        try:  # a Redis failure is retried in the background; the record is already written
            await self._retries.settle(reservation, num_tokens)
        except Exception:  # the reservation expires by itself; the record is written
            logger.exception("settling reservation %s failed", reservation.reservation_id)
        finally:
            self._metrics.reservations_in_flight.dec()

    def _count(
        self, info: RequestInfo, model: str | None, version: str | None, status: str
    ) -> None:
        metrics = self._metrics
        metrics.child(metrics.requests, info.endpoint, model or "", version or "", status).inc()

    def _submit(
        self,
        info: RequestInfo,
        *,
        served_model: str | None,
        model_version: str | None,
        route: str | None,
        status: UsageStatus,
        reject_reason: str | None = None,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        completion_tokens: int = 0,
        cost_micros: int = 0,
        ttft_ms: int | None = None,
        finish_reason: str | None = None,
    ) -> None:
        entry = UsageEntry(
            request_id=info.request_id,
            tenant_id=info.caller.tenant_id,
            key_id=info.caller.key_id,
            requested_model=info.requested_model[:200],
            served_model=served_model,
            model_version=model_version,
            routing_decision=route,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            completion_tokens=completion_tokens,
            cost_micros=cost_micros,
            status=status,
            reject_reason=reject_reason,
            streamed=info.is_stream,
            created_at=info.created_at,
            finished_at=datetime.now(timezone.utc),
            ttft_ms=ttft_ms,
            finish_reason=finish_reason,
        )
        try:
            self._writer.submit(entry)
        except Exception:
            logger.exception("usage record %s could not be accepted", info.request_id)
