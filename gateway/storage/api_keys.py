"""API keys: generated once, stored only as a hash, compared in constant time.

Why SHA-256 and not bcrypt/argon2: those are slow on purpose to protect *low-entropy* secrets
(passwords) against offline guessing. Our keys are 256 random bits (``secrets.token_urlsafe(32)``),
so guessing is hopeless whatever the hash, and a fast hash lets every request be authenticated
with one indexed lookup instead of tens of milliseconds of CPU.

The lookup goes by the hash of the presented key, then compares the stored and computed hashes
with ``hmac.compare_digest``, so no step compares secret material byte by byte with an early exit.
Keys and hashes are never logged; ``repr`` of the values here leaves them out.

A tenant's keys are listed oldest first in pages; the cursor is the last key id seen. Keys
are revoked, never deleted, so a cursor stays valid, and keys created meanwhile come after it.

``key_hash_prefixes`` reads only the first 8 bytes of each hash (16 hex digits), for the
gateway's filter of the keys that exist (``gateway.auth.known_key_filter``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from array import array
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from gateway.storage.models import ApiKeyRow, Tenant, utc_now
from gateway.storage.tenants import TenantInfo

KEY_PREFIX = "tw-"
DISPLAY_PREFIX_LENGTH = 12  # "tw-" and 9 random characters: enough for an admin to tell keys apart


# What `generate_key` makes: the prefix and 43 URL-safe base64 characters (32 random bytes).
_KEY_SHAPE = re.compile(re.escape(KEY_PREFIX) + r"[A-Za-z0-9_-]{43}")


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def is_well_shaped(token: str) -> bool:
    """Whether a presented token could be one of our keys at all. Checked before any lookup,
    so a malformed token is refused without a database read (the shape is public: this tells
    a caller nothing about which keys exist)."""
    return _KEY_SHAPE.fullmatch(token) is not None


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


HASH_PREFIX_HEX_DIGITS = 16  # the first 8 bytes of a key's SHA-256


def hash_prefix(key_hash: str) -> int:
    """The first 8 bytes of a key's hash (``hash_key``), as an unsigned 64-bit int."""
    return int(key_hash[:HASH_PREFIX_HEX_DIGITS], 16)


def verify_key(key: str, key_hash: str) -> bool:
    """Constant-time check that ``key`` hashes to ``key_hash``."""
    return hmac.compare_digest(hash_key(key).encode("ascii"), key_hash.encode("ascii"))


@dataclass(frozen=True)
class ApiKeyInfo:
    """What admins may see about a key: never the key or its hash."""

    id: str
    tenant_id: str
    prefix: str
    name: str
    priority: str | None
    created_at: datetime
    revoked_at: datetime | None
    expires_at: datetime | None

    def is_active(self, now: datetime) -> bool:
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)

    @classmethod
    def from_row(cls, row: ApiKeyRow) -> ApiKeyInfo:
        return cls(
            id=row.id,
            tenant_id=row.tenant_id,
            prefix=row.prefix,
            name=row.name,
            priority=row.priority,
            created_at=row.created_at,
            revoked_at=row.revoked_at,
            expires_at=row.expires_at,
        )


@dataclass(frozen=True)
class CreatedKey:
    """The result of creating a key: the only time the full key exists outside the client."""

    info: ApiKeyInfo
    key: str = field(repr=False)


@dataclass(frozen=True)
class AuthenticatedKey:
    key: ApiKeyInfo
    tenant: TenantInfo


def create_key(
    session: Session,
    tenant_id: str,
    *,
    name: str = "",
    priority: str | None = None,
    expires_at: datetime | None = None,
    now: datetime | None = None,
) -> CreatedKey:
    """Create a key for a live tenant. Raises ``LookupError`` if there is no such tenant."""
    tenant = session.get(Tenant, tenant_id)
    if tenant is None or tenant.deleted_at is not None:
        raise LookupError(f"no tenant {tenant_id!r}")
    key = generate_key()
    row = ApiKeyRow(
        id="key_" + secrets.token_hex(12),
        tenant_id=tenant_id,
        prefix=key[:DISPLAY_PREFIX_LENGTH],
        key_hash=hash_key(key),
        name=name,
        priority=priority,
        created_at=now or utc_now(),
        revoked_at=None,
        expires_at=expires_at,
    )
    session.add(row)
    session.flush()
    return CreatedKey(info=ApiKeyInfo.from_row(row), key=key)


def list_keys(session: Session, tenant_id: str) -> list[ApiKeyInfo]:
    """All keys of a tenant, revoked and expired ones included, oldest first."""
    query = (
        select(ApiKeyRow)
        .where(ApiKeyRow.tenant_id == tenant_id)
        .order_by(ApiKeyRow.created_at, ApiKeyRow.id)
    )
    return [ApiKeyInfo.from_row(row) for row in session.scalars(query)]


class UnknownCursorError(ValueError):
    """The cursor names no key of the tenant: it did not come from a page of its keys."""


@dataclass(frozen=True)
class ApiKeyPage:
    keys: list[ApiKeyInfo]
    next_cursor: str | None  # pass back as ``cursor``; None when this was the last page


def key_page(
    session: Session, tenant_id: str, *, cursor: str | None = None, limit: int
) -> ApiKeyPage:
    """At most ``limit`` of the tenant's keys after the key ``cursor``, oldest first (then
    by id). Raises ``UnknownCursorError`` if ``cursor`` is not one of the tenant's keys."""
    if limit < 1:
        raise ValueError("limit must be at least 1")
    query = (
        select(ApiKeyRow)
        .where(ApiKeyRow.tenant_id == tenant_id)
        .order_by(ApiKeyRow.created_at, ApiKeyRow.id)
        .limit(limit + 1)
    )
    if cursor is not None:
        after = session.get(ApiKeyRow, cursor)
        if after is None or after.tenant_id != tenant_id:
            raise UnknownCursorError(f"no key {cursor!r} of tenant {tenant_id!r}")
        query = query.where(
            or_(
                ApiKeyRow.created_at > after.created_at,
                and_(ApiKeyRow.created_at == after.created_at, ApiKeyRow.id > after.id),
            )
        )
    rows = list(session.scalars(query))
    has_more = len(rows) > limit
    rows = rows[:limit]
    return ApiKeyPage(
        keys=[ApiKeyInfo.from_row(row) for row in rows],
        next_cursor=rows[-1].id if has_more else None,
    )


def revoke_key(session: Session, key_id: str, *, now: datetime | None = None) -> bool:
    """Revoke a key; it fails its next lookup. ``False`` if unknown or already revoked."""
    row = session.get(ApiKeyRow, key_id)
    if row is None or row.revoked_at is not None:
        return False
    row.revoked_at = now or utc_now()
    session.flush()
    return True


def key_hash_prefixes(session: Session, *, created_since: datetime | None = None) -> array[int]:
    """``hash_prefix`` of every key (revoked and expired ones too), in no order; only the keys
    created at or after ``created_since`` if given. Streamed: 8 bytes a key in memory."""
    query = select(func.substr(ApiKeyRow.key_hash, 1, HASH_PREFIX_HEX_DIGITS))
    if created_since is not None:
        query = query.where(ApiKeyRow.created_at >= created_since)
    prefixes = array("Q")
    for prefix in session.scalars(query.execution_options(yield_per=10_000)):
        prefixes.append(int(prefix, 16))
    return prefixes


def authenticate(
    session: Session, key: str, *, now: datetime | None = None
) -> AuthenticatedKey | None:
    """The active key and its live tenant for a presented key, or ``None``.

    ``None`` covers unknown, revoked and expired keys and deleted tenants alike, so a caller
    cannot tell them apart by the answer.
    """
    return authenticate_hash(session, hash_key(key), now=now)


def authenticate_hash(
    session: Session, presented_hash: str, *, now: datetime | None = None
) -> AuthenticatedKey | None:
    """``authenticate`` for a key already hashed (with ``hash_key``)."""
    now = now or utc_now()
    found = session.execute(
        select(ApiKeyRow, Tenant)
        .join(Tenant, Tenant.id == ApiKeyRow.tenant_id)
        .where(ApiKeyRow.key_hash == presented_hash)
    ).first()
    if found is None:
        return None
    row, tenant = found
    if not hmac.compare_digest(row.key_hash.encode("ascii"), presented_hash.encode("ascii")):
        return None
    info = ApiKeyInfo.from_row(row)
    if not info.is_active(now) or tenant.deleted_at is not None:
        return None
    return AuthenticatedKey(key=info, tenant=TenantInfo.from_row(tenant))
