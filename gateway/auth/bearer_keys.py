"""Who is calling: ``Authorization: Bearer <key>`` looked up by hash.

``authenticate_request`` reads the database on every call for a token shaped like our keys
(``api_keys.is_well_shaped``; any other is refused unread): the tenant and admin APIs use
it. The completion endpoints go through ``key_cache``, which keeps keys in memory and still
sees a revocation at once on every replica.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import anyio
from sqlalchemy.exc import SQLAlchemyError
from starlette.requests import Request

from gateway.errors import RETRY_AFTER_S, ApiError, invalid_api_key
from gateway.storage.api_keys import AuthenticatedKey, authenticate, is_well_shaped, verify_key
from gateway.storage.database import Database
from policies.decision import Rejection
from policies.quota import PRIORITY_CLASSES, PriorityClass, TenantQuota

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    key_id: str
    tenant_id: str
    quota: TenantQuota
    key_priority: PriorityClass | None


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def bearer_matches(request: Request, key_hashes: Iterable[str]) -> bool:
    """Whether the bearer token hashes to one of ``key_hashes`` (SHA-256 hex), each compared
    in constant time."""
    token = bearer_token(request)
    if token is None:
        return False
    return any([verify_key(token, key_hash.lower()) for key_hash in key_hashes])


async def authenticate_request(database: Database, request: Request) -> Caller:
    """The caller, or a 401 ``invalid_api_key`` (a 503 if the database cannot answer)."""
    token = bearer_token(request)
    if token is None or not is_well_shaped(token):
        raise invalid_api_key()

    def lookup() -> Caller | None:
        with database.session() as session:
            found = authenticate(session, token)
        return None if found is None else caller_of(found)

    try:
        caller = await anyio.to_thread.run_sync(lookup)
    except SQLAlchemyError as exc:
        raise auth_unavailable(exc) from None
    if caller is None:
        raise invalid_api_key()
    return caller


def caller_of(found: AuthenticatedKey) -> Caller:
    quota = TenantQuota.from_dict(found.tenant.quota)
    if "tier" not in found.tenant.quota:
        quota = dataclasses.replace(quota, tier=found.tenant.tier)
    priority = found.key.priority if found.key.priority in PRIORITY_CLASSES else None
    return Caller(found.key.id, found.tenant.id, quota, priority)


def auth_unavailable(exc: Exception | None = None) -> ApiError:
    """The 503 for "keys cannot be checked now" (the database, or Redis, did not answer)."""
    if exc is not None:
        logger.warning("API key lookup failed: %s", type(exc).__name__)
    return ApiError(
        Rejection(
            503,
            "auth_unavailable",
            "server_error",
            "The gateway cannot check API keys right now; please retry.",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    )
