"""Who is on a console page, and may they do this: the session cookie read and checked, the
CSRF token of a form, the admin-only pages.

A page without a valid session (none, forged or expired) redirects to the sign-in page; a
tenant session on an admin page, or on another tenant's data, is a 403. A tenant session
is checked against its key on every request, in the database: a key revoked or expired, or
a tenant deleted, ends the session at once. Form bodies are read here too
(``application/x-www-form-urlencoded``, bounded), so every POST handler starts with the
same two lines: the session, then the form with its CSRF token checked.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from urllib.parse import parse_qs

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from gateway.console.console_session import SESSION_COOKIE, ConsoleSession, SessionCodec
from gateway.storage.database import Database
from gateway.storage.models import ApiKeyRow, Tenant

MAX_FORM_BYTES = 64 * 1024
CSRF_FIELD = "csrf_token"


class ConsoleDenied(Exception):
    """A refusal shown as an error page with ``status`` (400, 403, 404, 413, 429)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


class SignInRequired(Exception):
    """No valid session: the answer is a redirect to the sign-in page."""


class ConsoleGuard:
    def __init__(self, database: Database, codec: SessionCodec, now: Callable[[], datetime]):
        self._database = database
        self._codec = codec
        self._now = now

    async def session(self, request: Request) -> ConsoleSession:
        """The request's live session, or `SignInRequired`."""
        found = self._codec.decode(request.cookies.get(SESSION_COOKIE), self._now())
        if found is None:
            raise SignInRequired()
        if found.role == "tenant" and not await run_in_threadpool(self._is_key_live, found):
            raise SignInRequired()
        return found

    async def admin(self, request: Request) -> ConsoleSession:
        found = await self.session(request)
        if not found.is_admin:
            raise ConsoleDenied(403, "This page is for the admin; a tenant sees its own view.")
        return found

    async def form(self, request: Request, session: ConsoleSession) -> dict[str, str]:
        """The POSTed form, its CSRF token checked against ``session`` (403 if absent or
        wrong)."""
        form = await read_form(request)
        if not self._codec.is_csrf_valid(session.nonce, form.get(CSRF_FIELD)):
            raise csrf_refused()
        return form

    def csrf_token(self, session: ConsoleSession) -> str:
        return self._codec.csrf_token(session.nonce)

    def _is_key_live(self, session: ConsoleSession) -> bool:
        now = self._now()
        with self._database.session() as db:
            key = db.get(ApiKeyRow, session.key_id)
            if key is None or key.tenant_id != session.tenant_id or key.revoked_at is not None:
                return False
            if key.expires_at is not None and key.expires_at <= now:
                return False
            tenant = db.get(Tenant, key.tenant_id)
            return tenant is not None and tenant.deleted_at is None


async def read_form(request: Request) -> dict[str, str]:
    """An urlencoded form body, the first value of each field; 413 past `MAX_FORM_BYTES`."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise ConsoleDenied(413, f"A console form is at most {MAX_FORM_BYTES} bytes.")
    if not body:
        return {}  # no field at all: its CSRF check refuses it
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/x-www-form-urlencoded":
        raise ConsoleDenied(400, "Console forms are posted as application/x-www-form-urlencoded.")
    try:
        fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
    except UnicodeDecodeError:
        raise ConsoleDenied(400, "A console form must be UTF-8.") from None
    return {name: values[0] for name, values in fields.items()}


def csrf_refused() -> ConsoleDenied:
    return ConsoleDenied(
        403, "The form's CSRF token is missing or does not match: reload the page and retry."
    )
