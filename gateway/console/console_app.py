"""`build_console`: the console's own Starlette app, which the gateway mounts at ``/ui``.

Its routes, the security headers on every answer (`response_headers`), and two refusals
shown as pages: no session redirects to the sign-in page, and `ConsoleDenied` renders an
error page with its status. The stylesheet is served from the package (the
Content-Security-Policy allows styles from ``'self'`` only, and no script at all).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from importlib import resources

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from gateway.auth.epochs import AuthEpochs
from gateway.console.console_auth import ConsoleDenied, ConsoleGuard, SignInRequired
from gateway.console.console_context import ConsoleContext, FleetSources, template_environment
from gateway.console.console_session import SessionCodec
from gateway.console.console_settings import ConsoleSettings
from gateway.console.ops_pages import OpsPages
from gateway.console.response_headers import SecurityHeaders
from gateway.console.sign_in_pages import SIGN_IN_PATH, SignInPages, sign_in_attempts
from gateway.console.tenant_pages import TenantPages
from gateway.console.usage_pages import UsagePages
from gateway.settings import GatewaySettings
from gateway.storage.database import Database
from gateway.storage.models import utc_now
from gateway.storage.redis_client import RedisCommands

MOUNT_PATH = "/ui"


def build_console(
    gateway: GatewaySettings,
    database: Database,
    epochs: AuthEpochs,
    *,
    fleet: FleetSources | None = None,
    settings: ConsoleSettings | None = None,
    redis: RedisCommands | None = None,
    now: Callable[[], datetime] = utc_now,
) -> Starlette:
    """The console app (mount it at `MOUNT_PATH`). ``fleet``: the gateway's live replica
    state and metrics (None: the Fleet page is empty). ``redis``: the gateway's, where
    sign-in attempts are counted for every replica (None: in this process). ``now``: the
    clock (tests)."""
    settings = settings or ConsoleSettings()
    codec = SessionCodec(settings.session_secret, settings.session_ttl_s)
    context = ConsoleContext(
        gateway=gateway,
        settings=settings,
        database=database,
        epochs=epochs,
        codec=codec,
        guard=ConsoleGuard(database, codec, now),
        templates=template_environment(gateway.currency),
        fleet=fleet,
        now=now,
    )
    sign_in, tenants = SignInPages(context, sign_in_attempts(redis)), TenantPages(context)
    usage, ops = UsagePages(context), OpsPages(context)
    stylesheet = resources.files("gateway.console").joinpath("static/console.css").read_bytes()

    async def home(request: Request) -> Response:
        session = await context.guard.session(request)
        return RedirectResponse(
            f"{MOUNT_PATH}/tenants" if session.is_admin else f"{MOUNT_PATH}/my", status_code=303
        )

    async def css(request: Request) -> Response:
        return Response(stylesheet, media_type="text/css")

    async def denied(request: Request, exc: Exception) -> Response:
        if not isinstance(exc, ConsoleDenied):
            raise exc
        return _error_page(context, request, exc.status, exc.message, exc.headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        if not isinstance(exc, HTTPException):
            raise exc
        message = "No such console page." if exc.status_code == 404 else str(exc.detail)
        return _error_page(context, request, exc.status_code, message, None)

    async def to_sign_in(request: Request, exc: Exception) -> Response:
        return RedirectResponse(SIGN_IN_PATH, status_code=303)

    routes = [
        Route("/", home, methods=["GET"]),
        Route("/static/console.css", css, methods=["GET"]),
        Route("/sign-in", sign_in.form, methods=["GET"]),
        Route("/sign-in", sign_in.sign_in, methods=["POST"]),
        Route("/sign-out", sign_in.sign_out, methods=["POST"]),
        Route("/tenants", tenants.list_page, methods=["GET"]),
        Route("/tenants", tenants.create, methods=["POST"]),
        Route("/tenants/{tenant_id}", tenants.tenant_page, methods=["GET"]),
        Route("/tenants/{tenant_id}/quota", tenants.put_quota, methods=["POST"]),
        Route("/tenants/{tenant_id}/budgets", tenants.put_budget, methods=["POST"]),
        Route("/tenants/{tenant_id}/keys", tenants.create_key, methods=["POST"]),
        Route("/keys/{key_id}/revoke", tenants.revoke_key, methods=["POST"]),
        Route("/usage", usage.usage_page, methods=["GET"]),
        Route("/usage.csv", usage.usage_csv, methods=["GET"]),
        Route("/my", usage.own_page, methods=["GET"]),
        Route("/my/usage.csv", usage.own_csv, methods=["GET"]),
        Route("/fleet", ops.fleet_page, methods=["GET"]),
        Route("/audit", ops.audit_page, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(SecurityHeaders)],
        exception_handlers={
            ConsoleDenied: denied,
            SignInRequired: to_sign_in,
            HTTPException: http_error,
        },
    )


def _error_page(
    context: ConsoleContext,
    request: Request,
    status: int,
    message: str,
    headers: dict[str, str] | None,
) -> Response:
    page = context.templates.get_template("error.html").render(
        session=None, csrf_token=None, status=status, message=message
    )
    return HTMLResponse(page, status_code=status, headers=headers)
