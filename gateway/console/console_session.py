"""Console sessions: a signed, expiring cookie, and the CSRF tokens its forms carry.

The cookie holds who signed in (the admin, or a tenant through one of its keys: the key's
id, never the key), when the session ends and a random nonce, signed with HMAC-SHA256 under
the console's secret. Nothing is stored server-side, so a session needs no table; a tenant
session is checked against its key on every request (`console_auth`), so revoking the key
ends it at once.

CSRF: every form carries ``HMAC(secret, "csrf:" + nonce)`` of the session it was rendered
for; the sign-in form, which comes before any session, carries the same over a nonce in a
short-lived cookie of its own (a double submit that a third-party page can neither read nor
forge). A POST whose token does not match is refused with 403.

    token = b64(payload JSON) "." b64(HMAC-SHA256(secret, b64(payload JSON)))
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

Role = Literal["admin", "tenant"]
SESSION_COOKIE = "tw_console"
SIGN_IN_COOKIE = "tw_console_sign_in"
COOKIE_PATH = "/ui"
SIGN_IN_COOKIE_TTL_S = 900


@dataclass(frozen=True)
class ConsoleSession:
    """Who is signed in. ``tenant_id`` and ``key_id`` are set for a tenant session only."""

    role: Role
    expires_at: datetime
    nonce: str
    tenant_id: str | None = None
    key_id: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


class SessionCodec:
    """Signs and reads session cookies and CSRF tokens under one secret."""

    def __init__(self, secret: bytes, ttl_s: float) -> None:
        if len(secret) < 32:
            raise ValueError("the console's session secret must be at least 32 bytes")
        if not ttl_s > 0:
            raise ValueError(f"the console's session lifetime must be > 0 s, got {ttl_s}")
        self._secret = secret
        self.ttl_s = ttl_s

    def new_session(
        self,
        role: Role,
        now: datetime,
        *,
        tenant_id: str | None = None,
        key_id: str | None = None,
    ) -> ConsoleSession:
        return ConsoleSession(
            role=role,
            expires_at=now + timedelta(seconds=self.ttl_s),
            nonce=secrets.token_urlsafe(16),
            tenant_id=tenant_id,
            key_id=key_id,
        )

    def encode(self, session: ConsoleSession) -> str:
        payload = {
            "r": session.role,
            "e": session.expires_at.timestamp(),
            "n": session.nonce,
            "t": session.tenant_id,
            "k": session.key_id,
        }
        body = _b64(json.dumps(payload, separators=(",", ":")).encode())
        return f"{body}.{self._sign(body.encode())}"

    def decode(self, token: str | None, now: datetime) -> ConsoleSession | None:
        """The session, or None for a missing, forged, malformed or expired cookie."""
        if not token or token.count(".") != 1:
            return None
        body, signature = token.split(".")
        if not hmac.compare_digest(self._sign(body.encode()), signature):
            return None
        try:
            payload = json.loads(_unb64(body))
            role, expires_s, nonce = payload["r"], float(payload["e"]), str(payload["n"])
            tenant_id, key_id = payload.get("t"), payload.get("k")
        except (ValueError, KeyError, TypeError):
            return None
        if role not in ("admin", "tenant") or expires_s <= now.timestamp():
            return None
        if role == "tenant" and not (isinstance(tenant_id, str) and isinstance(key_id, str)):
            return None
        expires_at = datetime.fromtimestamp(expires_s, tz=now.tzinfo)
        return ConsoleSession(role, expires_at, nonce, tenant_id, key_id)

    def csrf_token(self, nonce: str) -> str:
        """The token a form rendered for the session (or sign-in cookie) ``nonce`` carries."""
        return self._sign(b"csrf:" + nonce.encode())

    def is_csrf_valid(self, nonce: str | None, presented: str | None) -> bool:
        if not nonce or not presented:
            return False
        return hmac.compare_digest(self.csrf_token(nonce), presented)

    def _sign(self, data: bytes) -> str:
        return _b64(hmac.new(self._secret, data, hashlib.sha256).digest())


def new_nonce() -> str:
    return secrets.token_urlsafe(16)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
