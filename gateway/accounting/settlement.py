"""The end of every request: write its one usage record, count it, settle its reservation.

Exactly one of `Accountant.reject` / `Accountant.record` runs per authenticated request; a
recorded request's reservation is then settled (`settle`; `finish` does both). An answered
request is recorded before the last bytes of its answer are sent and settled after, so a
gateway killed once the client has its whole answer loses no record.

No answer without its record: `record` returns once the record is durable (fsynced in the
usage writer's spill file, or committed to the database), and raises `AnswerNotRecorded`
when neither took it; the request path then answers a 503 instead (a stream: an error event
before ``[DONE]``) and settles the reservation to `AnswerNotRecorded.charge`: nothing
when the record is gone, its tokens and cost when it was kept (appended, only its fsync failed: it
still reaches the database). The ledger therefore always equals the records. A refusal's
record (`reject`) charges nothing and does not hold its answer back: it is appended at once,
and one the spill file refuses is logged and counted
(``tollway_gateway_usage_records_unaccepted{kind="refusal"}``).

When a reservation is settled, and to what::

    engine usage arrived (completed, or it came before the end)  -> prompt + completion (engine)
    stream stopped early (client gone, engine failed mid-stream) -> prompt + tokens relayed
    engine never answered / refused the request                  -> released: nothing is used

A record's ``prompt_tokens + completion_tokens`` is always exactly what token budgets were
settled to, and its ``cost_micros`` what money budgets were (a `Charge`; zero for rejected
and released requests), so summing the records rebuilds the ledger: per tenant, per key
(``key_id``) and per end user (``end_user``, the request's ``user``). Its
``finish_reason`` is the last one the engine sent, as the relay measured it ("stop",
"length", "tool_calls"; "abort" for a request the engine was asked to stop); null where none
came: refused, no engine answered, a stream whose client left before its finish chunk.

A settle (or release) that fails because Redis cannot answer never delays the response or
loses the record: it is tried again in the background (``settle_retries``).

With budget alerts on (``alerts:``), a settle that charged something then reads each
budget's balance and hands it to `gateway.alerts.budget_watch` (thresholds crossed become
outbox events). The budgets checked are those the request was held against, with their
limits and their own alert thresholds when they name any (`Admission.budgets`: the
tenant's, its key's, its end user's). Alerts never fail a
request: an error is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from opentelemetry.trace import Span, Status, StatusCode

from gateway.admission.outcomes import Admission, Refusal
from gateway.alerts.budget_watch import BudgetReading, BudgetRef, BudgetWatch
from gateway.auth.bearer_keys import Caller
from gateway.ledger.budget_ledger import BudgetAccount, BudgetLedger, Charge, Reservation
from gateway.ledger.settle_retries import LedgerRetries
from gateway.observability.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from gateway.storage.models import UsageStatus
from gateway.storage.usage_store import UsageEntry
from gateway.storage.usage_writer import RecordNotAccepted, UsageWriter
from gateway.upstream.stream_relay import UsageMeter
from policies.scoped_budgets import ScopedBudget, tenant_budgets

logger = logging.getLogger(__name__)


class AnswerNotRecorded(Exception):
    """The request's usage record was not accepted: its answer must not complete.
    ``charge``: what its reservation settles to (nothing unless the record was kept)."""

    def __init__(self, request_id: str, charge: Charge) -> None:
        super().__init__(f"the usage record of {request_id} was not accepted")
        self.charge = charge


@dataclass(frozen=True)
class RequestInfo:
    request_id: str
    endpoint: str
    caller: Caller
    requested_model: str
    is_stream: bool
    created_at: datetime
    span: Span
    end_user: str | None = None  # the request's ``user``, once its body is read


class Accountant:
    def __init__(
        self,
        settings: GatewaySettings,
        ledger: BudgetLedger,
        writer: UsageWriter,
        metrics: GatewayMetrics,
        retries: LedgerRetries | None = None,
        alerts: BudgetWatch | None = None,
    ) -> None:
        self._settings = settings
        self._ledger = ledger
        self._alerts = alerts
        self._writer = writer
        self._metrics = metrics
        self._retries = retries if retries is not None else LedgerRetries(ledger)

    def takes_records(self) -> bool:
        """Whether a request admitted now could have its record accepted (the usage writer's
        `UsageWriter.takes_records`): when not, it is refused before any engine works."""
        return self._writer.takes_records()

    def reject(self, info: RequestInfo, refusal: Refusal) -> None:
        reason = refusal.rejection.code
        metrics = self._metrics
        metrics.child(metrics.rejections, reason).inc()
        self._count(
            info, refusal.served_model, refusal.version, f"rejected:{refusal.rejection.status}"
        )
        entry = self._entry(
            info,
            served_model=refusal.served_model,
            model_version=refusal.version,
            route=refusal.route.reason if refusal.route else None,
            status=UsageStatus.REJECTED,
            reject_reason=reason,
        )
        try:
            self._writer.submit(entry)
        except Exception:
            metrics.child(metrics.usage_records_unaccepted, "refusal").inc()
            logger.error("usage record %s of a refusal was not accepted", info.request_id)
        info.span.set_status(Status(StatusCode.ERROR, reason))
        info.span.end()

    async def finish(
        self, info: RequestInfo, admission: Admission, meter: UsageMeter, *, was_answered: bool
    ) -> None:
        """`record`, then `settle`: for requests whose client gets no answer from an engine."""
        try:
            charge = await self.record(info, admission, meter, was_answered=was_answered)
        except AnswerNotRecorded as exc:
            charge = exc.charge
        await self.settle(admission, charge, info)

    async def record(
        self, info: RequestInfo, admission: Admission, meter: UsageMeter, *, was_answered: bool
    ) -> Charge:
        """Write the request's one usage record and count it; returns what its reservation
        settles to (its tokens and its cost). ``was_answered``: an engine accepted the
        request (so its tokens count).

        The record is durable (fsynced in the usage writer's spill file, or in the database)
        on return, so the request path calls this before the last bytes of an answer: a
        gateway that dies once the client has its whole answer has its record. `settle` may
        come after. Raises `AnswerNotRecorded` (counted, logged) when it was not accepted.
        """
        status = meter.status if meter.is_finished else UsageStatus.CANCELLED
        prompt, cached, completion = meter.tokens(admission.prompt_tokens)
        finish_reason = meter.finish_reason
        if not was_answered:
            prompt = cached = completion = 0
            finish_reason = None
        model, version = admission.served_model, admission.version
        prices = self._settings.models[version].prices  # each version is priced on its own
        cost_micros = prices.cost_micros(prompt, cached, completion)
        entry = self._entry(
            info,
            served_model=model,
            model_version=version,
            route=admission.route.reason if admission.route else None,
            status=status,
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
            cost_micros=cost_micros,
            ttft_ms=meter.ttft_ms,
            finish_reason=finish_reason,
        )
        span, metrics = info.span, self._metrics
        try:
            await self._writer.accept(entry)
        except RecordNotAccepted as exc:
            metrics.child(metrics.usage_records_unaccepted, "answer").inc()
            logger.error("usage record %s was not accepted: answered 503", info.request_id)
            span.set_status(Status(StatusCode.ERROR, "usage_records_unavailable"))
            span.end()
            kept = Charge(prompt + completion, cost_micros) if exc.is_kept else Charge(0)
            raise AnswerNotRecorded(info.request_id, kept) from exc
        metrics.child(metrics.tokens, model, version, "input").inc(prompt - cached)
        metrics.child(metrics.tokens, model, version, "cached_input").inc(cached)
        metrics.child(metrics.tokens, model, version, "output").inc(completion)
        self._count(info, model, version, status.value)
        span.set_attribute("gen_ai.response.model", model)
        span.set_attribute("tollway.model_version", version)
        span.set_attribute("gen_ai.usage.input_tokens", prompt)
        span.set_attribute("gen_ai.usage.output_tokens", completion)
        span.set_attribute("tollway.usage.status", status.value)
        if status is UsageStatus.UPSTREAM_ERROR:
            span.set_status(Status(StatusCode.ERROR, "upstream_error"))
        span.end()
        return Charge(prompt + completion, cost_micros)

    async def settle(
        self, admission: Admission, charge: Charge, info: RequestInfo | None = None
    ) -> None:
        """Settle the request's reservation to ``charge`` (`record`'s), or release it; then
        check the budgets it was held against (``admission.budgets``; without them, those of
        ``info``'s tenant) for alert thresholds crossed."""
        reservation = admission.reservation
        if reservation is None:
            return
        try:  # a Redis failure is retried in the background; the record is already written
            await self._retries.settle(reservation, charge.tokens, charge.micros)
        except Exception:  # the reservation expires by itself; the record is written
            logger.exception("settling reservation %s failed", reservation.reservation_id)
        finally:
            self._metrics.reservations_in_flight.dec()
        if self._alerts is not None and charge.tokens > 0:
            budgets = admission.budgets
            if not budgets and info is not None:
                budgets = tuple(tenant_budgets(info.caller.quota))
            await self._check_alerts(self._alerts, reservation, budgets)

    async def _check_alerts(
        self, alerts: BudgetWatch, reservation: Reservation, budgets: Sequence[ScopedBudget]
    ) -> None:
        by_account = {BudgetAccount.of(budget): budget for budget in budgets}
        for hold in reservation.holds:
            budget = by_account.get(hold.account)
            if budget is None:
                continue
            account, tenant_id = hold.account, reservation.tenant_id
            try:
                balance = await self._ledger.balance(tenant_id, hold.period_key, account)
                await alerts.check(
                    BudgetRef(tenant_id, account.scope, account.subject, account.unit),
                    BudgetReading(hold.period_key, budget.limit, balance.used),
                    budget.alert_thresholds,  # None: the settings' default
                )
            except Exception:  # an alert must never fail the request
                logger.exception(
                    "checking the alert thresholds of tenant %s's %s budget failed",
                    tenant_id,
                    account.scope,
                )

    def _count(
        self, info: RequestInfo, model: str | None, version: str | None, status: str
    ) -> None:
        metrics = self._metrics
        metrics.child(metrics.requests, info.endpoint, model or "", version or "", status).inc()

    def _entry(
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
    ) -> UsageEntry:
        return UsageEntry(
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
            end_user=info.end_user,
        )
