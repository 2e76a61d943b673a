"""Signing in to the console and out of it.

Sign-in takes the admin key (compared by SHA-256 in constant time, as the admin API does) or
a tenant's API key (looked up by hash; the session then holds the key's id and its tenant,
the tenant's own view). The key travels only in the POSTed form: never in a URL, a cookie or
a log line. The form's CSRF token is tied to a nonce cookie set with the form, since there is
no session yet. Attempts are limited per client address (the gateway's sliding window, with
`check_rate_limit` deciding and naming the ``Retry-After``): each address gets
``sign_in_attempts_per_minute`` tries, right or wrong, counted in Redis when the gateway has
one (`RedisRateLimitStore`: every replica shares the allowance, so more replicas give an
address no more tries) and in process otherwise. Redis failing refuses sign-in (503) rather
than let attempts go uncounted.
"""

from __future__ import annotations

import logging

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from gateway.console.console_auth import CSRF_FIELD, ConsoleDenied, SignInRequired, read_form
from gateway.console.console_context import ConsoleContext
from gateway.console.console_session import (
    COOKIE_PATH,
    SESSION_COOKIE,
    SIGN_IN_COOKIE,
    SIGN_IN_COOKIE_TTL_S,
    ConsoleSession,
    new_nonce,
)
from gateway.ratelimit.memory_store import MemoryRateLimitStore
from gateway.ratelimit.rate_limit_store import RateLimitStore, RateLimitUnavailable
from gateway.ratelimit.redis_store import RedisRateLimitStore
from gateway.storage import api_keys
from gateway.storage.redis_client import RedisCommands
from policies.decision import Rejection
from policies.rate_limit import check_rate_limit

logger = logging.getLogger(__name__)
KEY_FIELD = "api_key"
SIGN_IN_PATH = "/ui/sign-in"
ATTEMPTS_WINDOW_S = 60.0
ATTEMPTS_KEY_PREFIX = "tollway:console:sign-in"


def sign_in_attempts(redis: RedisCommands | None) -> RateLimitStore:
    """Where sign-in attempts are counted: in Redis, shared by the replicas, when there is
    one; else in this process."""
    if redis is None:
        return MemoryRateLimitStore(window_s=ATTEMPTS_WINDOW_S)
    return RedisRateLimitStore(redis, ATTEMPTS_KEY_PREFIX, window_s=ATTEMPTS_WINDOW_S)


class SignInPages:
    def __init__(self, context: ConsoleContext, attempts: RateLimitStore) -> None:
        self._context = context
        self._attempts = attempts

    async def form(self, request: Request) -> Response:
        return self._form(request, error=None, status_code=200)

    async def sign_in(self, request: Request) -> Response:
        context = self._context
        await self._count_attempt(request)
        form = await read_form(request)
        nonce = request.cookies.get(SIGN_IN_COOKIE)
        if not context.codec.is_csrf_valid(nonce, form.get(CSRF_FIELD)):
            raise ConsoleDenied(
                403, "The sign-in form's CSRF token is missing or stale: reload the page."
            )
        session = await self._session_for(form.get(KEY_FIELD, "").strip())
        if session is None:
            logger.info("console sign-in refused from %s", _client(request))
            return self._form(
                request, error="That is neither the admin key nor a live API key.", status_code=401
            )
        logger.info(
            "console sign-in as %s from %s",
            "admin" if session.is_admin else f"tenant {session.tenant_id} ({session.key_id})",
            _client(request),
        )
        response = RedirectResponse("/ui/", status_code=303)
        response.set_cookie(
            SESSION_COOKIE,
            context.codec.encode(session),
            max_age=int(context.settings.session_ttl_s),
            path=COOKIE_PATH,
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        response.delete_cookie(SIGN_IN_COOKIE, path=COOKIE_PATH)
        return response

    async def sign_out(self, request: Request) -> Response:
        try:
            session = await self._context.guard.session(request)
        except SignInRequired:
            return RedirectResponse(SIGN_IN_PATH, status_code=303)
        await self._context.guard.form(request, session)
        response = RedirectResponse(SIGN_IN_PATH, status_code=303)
        response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH)
        return response

    async def _session_for(self, key: str) -> ConsoleSession | None:
        context = self._context
        now = context.now()
        admin_hash = context.gateway.admin_key_hash
        if admin_hash is not None and api_keys.verify_key(key, admin_hash.lower()):
            return context.codec.new_session("admin", now)
        if not api_keys.is_well_shaped(key):
            return None

        def lookup() -> api_keys.AuthenticatedKey | None:
            with context.database.session() as session:
                return api_keys.authenticate(session, key, now=now)

        found = await run_in_threadpool(lookup)
        if found is None:
            return None
        return context.codec.new_session(
            "tenant", now, tenant_id=found.tenant.id, key_id=found.key.id
        )

    async def _count_attempt(self, request: Request) -> None:
        limit = self._context.settings.sign_in_attempts_per_minute
        now = self._context.now().timestamp()
        try:
            report = await self._attempts.hit(_client(request), 0, limit, None, now)
        except RateLimitUnavailable:
            logger.warning("console sign-in refused: its attempts could not be counted")
            raise ConsoleDenied(
                503,
                "Sign-in is unavailable for a moment (its attempts cannot be counted): retry.",
                headers={"Retry-After": "1"},
            ) from None
        decision = check_rate_limit(report, rpm=limit, tpm=None, request_tokens=0, now=now)
        if isinstance(decision, Rejection):
            raise ConsoleDenied(
                429,
                f"Too many sign-in attempts from this address: at most {limit} a minute.",
                headers=dict(decision.headers),
            )

    def _form(self, request: Request, error: str | None, status_code: int) -> Response:
        nonce = new_nonce()
        response = self._context.templates.get_template("sign_in.html").render(
            session=None,
            csrf_token=self._context.codec.csrf_token(nonce),
            error=error,
        )
        page = HTMLResponse(response, status_code=status_code)
        page.set_cookie(
            SIGN_IN_COOKIE,
            nonce,
            max_age=SIGN_IN_COOKIE_TTL_S,
            path=COOKIE_PATH,
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return page


def _client(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown"
