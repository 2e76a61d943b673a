"""The end of every request: settle its reservation, write its one usage record, count it.

Exactly one of `Accountant.reject` / `Accountant.finish` runs per authenticated request.

When a reservation is settled, and to what::

    engine usage arrived (completed, or it came before the end)  -> prompt + completion (engine)
    stream stopped early (client gone, engine failed mid-stream) -> prompt + tokens relayed
    engine never answered / refused the request                  -> released: nothing is used

A record's ``prompt_tokens + completion_tokens`` is always exactly what was settled (zero for
rejected and released requests), so summing the records rebuilds the ledger.

A settle (or release) that fails because Redis cannot answer never delays the response or
loses the record: it is tried again in the background (``ledger_retries``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone

from opentelemetry.trace import Span, Status, StatusCode

from gateway.admission import Admission, Refusal
from gateway.auth import Caller
from gateway.budget_ledger import BudgetLedger
from gateway.ledger_retries import LedgerRetries
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from gateway.storage.models import UsageStatus
from gateway.storage.usage_store import UsageEntry
from gateway.storage.usage_writer import UsageWriter
from gateway.stream_relay import UsageMeter

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
        self._count(info, refusal.served_model, f"rejected:{refusal.rejection.status}")
        self._submit(
            info,
            served_model=refusal.served_model,
            route=refusal.route.reason if refusal.route else None,
            status=UsageStatus.REJECTED,
            reject_reason=reason,
        )
        info.span.set_status(Status(StatusCode.ERROR, reason))
        info.span.end()

    async def finish(
        self, info: RequestInfo, admission: Admission, meter: UsageMeter, *, was_answered: bool
    ) -> None:
        """``was_answered``: an engine accepted the request (so its tokens count)."""
        status = meter.status if meter.is_finished else UsageStatus.CANCELLED
        prompt, cached, completion = meter.tokens(admission.prompt_tokens)
        if not was_answered:
            prompt = cached = completion = 0
        reservation = admission.reservation
        if reservation is not None:
            try:  # a Redis failure is retried in the background; the record is still written
                await self._retries.settle(reservation, prompt + completion)
            except Exception:  # the reservation expires by itself; the record is still written
                logger.exception("settling reservation %s failed", reservation.reservation_id)
            finally:
                self._metrics.reservations_in_flight.dec()
        model = admission.served_model
        prices = self._settings.models[model].prices
        metrics = self._metrics
        metrics.child(metrics.tokens, model, "input").inc(prompt - cached)
        metrics.child(metrics.tokens, model, "cached_input").inc(cached)
        metrics.child(metrics.tokens, model, "output").inc(completion)
        self._count(info, model, status.value)
        self._submit(
            info,
            served_model=model,
            route=admission.route.reason if admission.route else None,
            status=status,
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
            cost_micros=prices.cost_micros(prompt, cached, completion),
            ttft_ms=meter.ttft_ms,
        )
        span = info.span
        span.set_attribute("gen_ai.response.model", model)
        span.set_attribute("gen_ai.usage.input_tokens", prompt)
        span.set_attribute("gen_ai.usage.output_tokens", completion)
        span.set_attribute("tollway.usage.status", status.value)
        if status is UsageStatus.UPSTREAM_ERROR:
            span.set_status(Status(StatusCode.ERROR, "upstream_error"))
        span.end()

    def _count(self, info: RequestInfo, model: str | None, status: str) -> None:
        metrics = self._metrics
        metrics.child(metrics.requests, info.endpoint, model or "", status).inc()

    def _submit(
        self,
        info: RequestInfo,
        *,
        served_model: str | None,
        route: str | None,
        status: UsageStatus,
        reject_reason: str | None = None,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        completion_tokens: int = 0,
        cost_micros: int = 0,
        ttft_ms: int | None = None,
    ) -> None:
        entry = UsageEntry(
            request_id=info.request_id,
            tenant_id=info.caller.tenant_id,
            key_id=info.caller.key_id,
            requested_model=info.requested_model[:200],
            served_model=served_model,
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
        )
        try:
            self._writer.submit(entry)
        except Exception:
            logger.exception("usage record %s could not be accepted", info.request_id)
