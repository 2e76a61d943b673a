"""`build_gateway`: the gateway's Starlette app, composed from the settings.

Start-up opens nothing on the network but the engines: the Redis and httpx clients connect
on first use, and the upstream pool resolves its ``dns://`` upstreams and checks every
replica once (`UpstreamPool.start`) before serving. The lifespan also starts the usage
writer's thread and waits (up to ``USAGE_REPLAY_WAIT_S``) until the records it replayed
from its spill file, left by a gateway that crashed, are in the database: budgets are
rebuilt from the database on first use, so serving earlier would forget those records and
let tenants overspend by them. It then starts following each engine replica's prefix-cache
event stream (`gateway.upstream.replica_router`, for replica choice, and for the load the
small/large routing reads, `gateway.upstream.pool_load`; the tasks connect in the
background, a request never waits for them; a replica that leaves is no longer followed).
With budget alerts configured it starts their webhook delivery, which reads the outbox at
once: events a stopped gateway left undelivered are sent first (`gateway.alerts`). The
admins' console is its own app mounted at ``/ui`` (`gateway.console`), its sessions signed
with ``console.session_secret`` (valid on every replica that shares it), its sign-in
attempts counted in Redis when there is one (an allowance every replica shares). On
shutdown it stops those and the alerts' delivery, closes the upstream pool (its discovery
and health checks, then its client), Redis, the usage writer (flushing what it can; the
rest stays in its spill file) and the tracer provider, in that order.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from opentelemetry.sdk.trace.export import SpanExporter
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from gateway.accounting.settlement import Accountant
from gateway.admission.admission_store import AdmissionStore
from gateway.admission.admitter import Admitter
from gateway.admission.counting_step import CountingStep
from gateway.admission.memory_admission_store import MemoryAdmissionStore
from gateway.admission.planning_step import PlanningStep
from gateway.admission.redis_admission_store import RedisAdmissionStore
from gateway.admission.scoped_budget_lookup import ScopedBudgetLookup
from gateway.admission.token_counter import TokenCounter, exact_counter, for_openai_model
from gateway.alerts.budget_watch import BudgetWatch
from gateway.alerts.webhook_delivery import WebhookDelivery
from gateway.api.admin_api import admin_routes
from gateway.api.completions import chat_completions, completions
from gateway.api.handler_context import GatewayContext
from gateway.api.model_cards import list_models, retrieve_model
from gateway.api.openapi import openapi_route
from gateway.api.readiness import Readiness, readiness_route
from gateway.api.request_id import IssuedIdServerErrorMiddleware
from gateway.api.tenant_api import tenant_routes
from gateway.auth.bearer_keys import bearer_matches
from gateway.auth.epochs import AuthEpochs, MemoryAuthEpochs, RedisAuthEpochs
from gateway.auth.key_cache import KeyCache
from gateway.console.console_app import MOUNT_PATH, build_console
from gateway.console.console_context import FleetSources
from gateway.console.console_settings import ConsoleSettings
from gateway.console_section import ConsoleSection
from gateway.errors import EXCEPTION_HANDLERS, ApiError
from gateway.ledger.balance_rebuild import BalanceRebuild
from gateway.ledger.budget_ledger import BudgetLedger
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.ledger.redis_ledger import RedisBudgetLedger
from gateway.ledger.settle_retries import LedgerRetries
from gateway.observability.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.observability.tracing import build_tracer_provider, tracer_from
from gateway.ratelimit.memory_store import MemoryRateLimitStore
from gateway.rollouts import LiveRollouts
from gateway.settings import GatewaySettings, ModelSettings
from gateway.storage.database import Database
from gateway.storage.redis_client import LeanRedis
from gateway.storage.usage_writer import UsageWriter
from gateway.upstream.dns_discovery import Resolver, system_resolver
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.pool_load import PoolLoadView, routed_large_models
from gateway.upstream.replica_router import ReplicaRouter
from policies.decision import Rejection

logger = logging.getLogger(__name__)

SPILL_FILENAME = "usage-spill.jsonl"
USAGE_FLUSH_ON_SHUTDOWN_S = 5.0
USAGE_REPLAY_WAIT_S = 10.0  # the database down at start-up delays serving this long at most


def build_gateway(
    settings: GatewaySettings,
    *,
    span_exporter: SpanExporter | None = None,
    extra_routes: list[BaseRoute] | None = None,
    resolver: Resolver = system_resolver,
) -> Starlette:
    """The gateway app. ``span_exporter`` overrides the OTLP exporter, ``resolver`` the
    system's DNS resolver for ``dns://`` upstreams (tests)."""
    database = Database(settings.resolved_database_url)
    redis = (
        LeanRedis(
            settings.redis_url,
            connect_timeout_s=settings.redis_connect_timeout_s,
            timeout_s=settings.redis_timeout_s,
        )
        if settings.redis_url is not None
        else None
    )
    ledger: BudgetLedger
    store: AdmissionStore
    epochs: AuthEpochs
    if redis is not None:
        ledger, store, epochs = (
            RedisBudgetLedger(redis),
            RedisAdmissionStore(redis),
            RedisAuthEpochs(redis),
        )
    else:
        memory_ledger, memory_epochs = MemoryBudgetLedger(), MemoryAuthEpochs()
        store = MemoryAdmissionStore(memory_ledger, MemoryRateLimitStore(), memory_epochs)
        ledger, epochs = memory_ledger, memory_epochs
    keys = KeyCache(
        database,
        epochs,
        ttl_s=settings.auth_cache_ttl_s,
        stale_ttl_s=settings.auth_stale_ttl_s,
        unknown_ttl_s=settings.auth_unknown_key_ttl_s,
        epochs_fail_open=settings.redis_failure_mode == "open",
    )
    metrics = GatewayMetrics()
    upstreams = UpstreamPool(
        settings.models, watch=settings.replica_watch, resolver=resolver, metrics=metrics
    )
    counters = token_counters(settings.models)
    replica_router = ReplicaRouter(settings.models, upstreams.client)
    upstreams.replica_order = replica_router
    pool_load = PoolLoadView(upstreams.replica_set, replica_router, routed_large_models(settings))
    provider = build_tracer_provider(settings.otel_endpoint, span_exporter)
    writer = UsageWriter(database, Path(settings.data_dir) / SPILL_FILENAME)
    readiness = Readiness(writer)  # not ready while the spill file refuses records
    retries = LedgerRetries(ledger)
    delivery = watch = None
    if settings.alerts is not None:
        delivery = WebhookDelivery(database, settings.alerts, metrics=metrics)
        watch = BudgetWatch(database, settings.alerts.thresholds, on_new_events=delivery.wake)
    accountant = Accountant(settings, ledger, writer, metrics, retries, alerts=watch)
    rollouts = LiveRollouts(settings.rollouts)  # replaced whole by a config reload
    context = GatewayContext(
        settings=settings,
        database=database,
        upstreams=upstreams,
        keys=keys,
        admitter=Admitter(
            PlanningStep(settings, counters, rollouts, pool_load),
            CountingStep(
                store,
                epochs,
                BalanceRebuild(ledger, database),
                reservation_ttl_s=settings.reservation_ttl_s,
                is_fail_open=settings.redis_failure_mode == "open",
                metrics=metrics,
                retries=retries,
                scoped=ScopedBudgetLookup(database, ttl_s=settings.auth_cache_ttl_s),
                prices=lambda version: settings.models[version].prices,
                currency=settings.currency,
            ),
            keys,
        ),
        rollouts=rollouts,
        accountant=accountant,
        metrics=metrics,
        tracer=tracer_from(provider),
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        writer.start()
        if writer.num_pending and not await anyio.to_thread.run_sync(
            writer.flush, USAGE_REPLAY_WAIT_S
        ):
            logger.warning(
                "usage records replayed from the spill file are not in the database yet: "
                "budgets rebuilt before they are may count too little"
            )
        await upstreams.start()
        replica_router.start(
            {name: upstreams.replica_set.members(name) for name in settings.models}
        )
        pool_load.start()
        if delivery is not None:
            delivery.start()
        try:
            yield
        finally:
            if delivery is not None:
                await delivery.aclose()
            await replica_router.aclose()
            await upstreams.aclose()
            await retries.aclose()
            if redis is not None:
                await redis.aclose()
            if not await anyio.to_thread.run_sync(writer.close, USAGE_FLUSH_ON_SHUTDOWN_S):
                logger.warning("usage records still pending stay in the spill file")
            database.dispose()
            if provider is not None:
                provider.shutdown()

    completion_routes: list[BaseRoute] = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
    ]
    routes: list[BaseRoute] = [
        *completion_routes,
        metrics_route(settings),
        Route("/health", health, methods=["GET"]),
        readiness_route(readiness),
        *management_routes(
            settings, database, ledger, epochs, keys, also_described=completion_routes
        ),
        Mount(
            MOUNT_PATH,
            app=build_console(
                settings,
                database,
                epochs,
                fleet=FleetSources(
                    upstreams.replica_set, replica_router.index, metrics.registry, rollouts
                ),
                settings=console_settings(settings.console),
                redis=redis,
            ),
        ),
        *(extra_routes or []),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(IssuedIdServerErrorMiddleware)],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.gateway = context
    app.state.readiness = readiness  # drained on SIGTERM (gateway.launcher.draining_server)
    return app


def management_routes(
    settings: GatewaySettings,
    database: Database,
    ledger: BudgetLedger,
    epochs: AuthEpochs,
    keys: KeyCache | None = None,
    *,
    also_described: Sequence[BaseRoute] = (),
) -> list[BaseRoute]:
    """The tenant API (``/v1/usage``, ``/v1/budget``), the admin API when an admin key is
    configured, and ``/openapi.json`` describing them; all share this app's database, budget
    ledger and auth epochs (bumped by every change to keys and quotas). ``keys`` tells the
    admin API a tenant's key (403) from an unknown one (401). ``also_described``: more routes
    for ``/openapi.json`` (the completion endpoints)."""
    routes = tenant_routes(database, ledger, currency=settings.currency)
    if settings.admin_key_hash is not None:
        routes += admin_routes(
            database,
            settings.admin_key_hash,
            ledger,
            auth_epochs=epochs,
            keys=keys,
            currency=settings.currency,
        )
    else:
        logger.warning("admin_key_hash is not set: the admin API is off")
    described = [*also_described, *routes]
    return [*routes, openapi_route(described, models=sorted(settings.known_models))]


def console_settings(section: ConsoleSection) -> ConsoleSettings:
    """The console's settings from the gateway's ``console:``: its session secret, shared by
    every replica given the same one; without one, a secret of this process's own."""
    if section.session_secret is None:
        logger.warning(
            "console.session_secret is not set: console sessions are valid only on this "
            "gateway replica and until it restarts (set TOLLWAY_CONSOLE_SESSION_SECRET)"
        )
        return ConsoleSettings()
    return ConsoleSettings(session_secret=section.session_secret.encode("utf-8"))


def token_counters(models: Mapping[str, ModelSettings]) -> dict[str, TokenCounter]:
    """Exact counters for our checkpoints (tiktoken, or the engine's tokenizer where tiktoken
    can't); ``cl100k_base`` (by model name) for the rest.

    Models on the same checkpoint share one counter (a GGUF file takes seconds to open)."""
    counters: dict[str, TokenCounter] = {}
    by_checkpoint: dict[Path, TokenCounter] = {}
    for name, model in models.items():
        if model.checkpoint is None:
            counters[name] = for_openai_model(name)
            continue
        if model.checkpoint not in by_checkpoint:
            by_checkpoint[model.checkpoint] = exact_counter(model.checkpoint)
        counters[name] = by_checkpoint[model.checkpoint]
    return counters


def metrics_route(settings: GatewaySettings) -> Route:
    """``GET /metrics``: Prometheus text for the bearer of the metrics token or the admin key
    (the labels name models and outcomes of every tenant's traffic); anyone else gets 401."""
    key_hashes = [h for h in (settings.metrics_token_hash, settings.admin_key_hash) if h]

    async def render_metrics(request: Request) -> Response:
        if not bearer_matches(request, key_hashes):
            raise _metrics_token_required()
        payload = GatewayContext.of(request).metrics.render()
        return Response(payload, media_type=CONTENT_TYPE)

    return Route("/metrics", render_metrics, methods=["GET"])


def _metrics_token_required() -> ApiError:
    return ApiError(
        Rejection(
            401,
            "invalid_api_key",
            "invalid_request_error",
            "GET /metrics needs `Authorization: Bearer <metrics token>` "
            "(the token whose SHA-256 is metrics_token_hash) or the admin key.",
            headers={"WWW-Authenticate": "Bearer"},
        )
    )


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})
