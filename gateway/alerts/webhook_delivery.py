"""The background task that posts the outbox's alert events to the webhook, at least once.

::

    start: read the outbox at once (events a stopped gateway left undelivered go first)
    loop:  claim the due events (leased) -> post each, signed (`webhook_signature`)
             2xx                  -> delivered
             anything else, error -> due again after retry_first_delay_s, doubling up to
                                     retry_max_delay_s; after max_attempts: failed
           then sleep until the next event is due, poll_interval_s at most (another
           replica may have written one), or until `wake` (this one just did)

Every attempt of an event sends the same body and the same ``webhook-id``; the signature and
``webhook-timestamp`` are made afresh per attempt, so a receiver's replay window holds for
retries too. A receiver that answered 2xx to a delivery whose reply was lost gets it again:
it drops a ``webhook-id`` it has seen. An error is logged and kept on the event (its
``last_error``), never raised into the gateway; the database failing only delays delivery.

With the gateway's metrics, every attempt is counted by outcome (delivered, refused,
unreachable), every event given up on too, and each pass ends by reading how many events
the outbox still holds pending (the gauge ``tollway_gateway_alert_events_pending``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import httpx
from starlette.concurrency import run_in_threadpool

from gateway.alert_settings import AlertSettings
from gateway.alerts.webhook_signature import signed_headers
from gateway.observability.metrics import GatewayMetrics
from gateway.storage import alert_outbox
from gateway.storage.database import Database

logger = logging.getLogger(__name__)

BATCH_SIZE = 32
LEASE_MARGIN_S = 5.0  # a claim outlives one post's timeout by this much
MIN_WAIT_S = 0.05  # an event due but held by another replica's claim: no busy loop


class WebhookDelivery:
    def __init__(
        self,
        database: Database,
        settings: AlertSettings,
        *,
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.time,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        """``client``: the HTTP client to post with (tests pass a transport; None: our own).
        ``metrics``: where attempts and the pending events are counted (None: nowhere)."""
        self._database = database
        self._metrics = metrics
        self._settings = settings
        self._client = client
        self._owns_client = client is None
        self._clock = clock
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the delivery loop on the running event loop."""
        if self._client is None:
            self._client = httpx.AsyncClient(follow_redirects=False)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="alert-webhooks")

    def wake(self) -> None:
        """New events were committed: look at the outbox now."""
        self._wakeup.set()

    async def aclose(self) -> None:
        """Stop the loop; events still pending stay in the outbox for the next start."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def deliver_due(self) -> int:
        """One pass: claim the events due now and post each; returns how many were claimed."""
        now = self._now()
        lease_s = self._settings.timeout_s + LEASE_MARGIN_S
        claimed = await run_in_threadpool(self._claim, now, lease_s)
        for event in claimed:
            error = await self._post(event)
            await run_in_threadpool(self._mark, event, error)
        if self._metrics is not None:
            pending = await run_in_threadpool(self._num_pending)
            self._metrics.alert_events_pending.set(pending)
        return len(claimed)

    async def _run(self) -> None:
        while True:
            self._wakeup.clear()
            try:
                num_claimed = await self.deliver_due()
                if num_claimed == BATCH_SIZE:
                    continue  # more may be due at once
                wait_s = await run_in_threadpool(self._seconds_to_next_due)
            except Exception:
                logger.exception("delivering alert webhooks failed; trying again shortly")
                wait_s = self._settings.poll_interval_s
            with contextlib.suppress(asyncio.TimeoutError):  # not TimeoutError on 3.10
                await asyncio.wait_for(self._wakeup.wait(), timeout=wait_s)

    async def _post(self, event: alert_outbox.DueAlert) -> str | None:
        """Post one event; None when the receiver took it, else why not."""
        if self._client is None:
            raise RuntimeError("WebhookDelivery.start() must run before events are posted")
        body = event.body.encode("utf-8")
        timestamp = int(self._clock())
        headers = signed_headers(self._settings.webhook_secret, event.event_id, timestamp, body)
        try:
            response = await self._client.post(
                self._settings.webhook_url,
                content=body,
                headers=headers,
                timeout=self._settings.timeout_s,
            )
        except httpx.HTTPError as exc:
            self._count_attempt("unreachable")
            return f"{type(exc).__name__}: {exc}"
        if 200 <= response.status_code < 300:
            self._count_attempt("delivered")
            return None
        self._count_attempt("refused")
        return f"HTTP {response.status_code}"

    def _count_attempt(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.child(self._metrics.alert_delivery_attempts, outcome).inc()

    def _claim(self, now: datetime, lease_s: float) -> list[alert_outbox.DueAlert]:
        with self._database.transaction() as session:
            return alert_outbox.claim_due(session, now=now, lease_s=lease_s, limit=BATCH_SIZE)

    def _mark(self, event: alert_outbox.DueAlert, error: str | None) -> None:
        now = self._now()
        with self._database.transaction() as session:
            if error is None:
                alert_outbox.mark_delivered(session, event.event_id, now=now)
                return
            retry_at = None
            if event.num_attempts < self._settings.max_attempts:
                delay_s = self._settings.retry_delay_s(event.num_attempts)
                retry_at = now + timedelta(seconds=delay_s)
            alert_outbox.mark_attempt_failed(
                session, event.event_id, error=error, retry_at=retry_at
            )
        if retry_at is None:
            if self._metrics is not None:
                self._metrics.alert_events_failed.inc()
            logger.error(
                "alert %s was not delivered after %d attempts (%s): marked failed",
                event.event_id,
                event.num_attempts,
                error,
            )
        else:
            logger.warning(
                "alert %s: attempt %d failed (%s); next at %s",
                event.event_id,
                event.num_attempts,
                error,
                retry_at.isoformat(),
            )

    def _num_pending(self) -> int:
        with self._database.transaction() as session:
            return alert_outbox.num_pending(session)

    def _seconds_to_next_due(self) -> float:
        with self._database.transaction() as session:
            due_at = alert_outbox.next_due_at(session)
        poll_s = self._settings.poll_interval_s
        if due_at is None:
            return poll_s
        return min(poll_s, max(MIN_WAIT_S, (due_at - self._now()).total_seconds()))

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self._clock(), timezone.utc)
