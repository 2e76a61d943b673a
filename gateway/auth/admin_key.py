"""Who may call the admin API: the bearer of the admin key, and nobody else.

The admin key is compared by SHA-256 in constant time. A token that is not the admin key
gets a 401, unless it is a live tenant API key: that caller is known but not allowed, a 403
(``permission_error`` / ``insufficient_permissions``, the status OpenAI's client libraries
raise as ``PermissionDeniedError``). Telling the two apart costs one key-cache lookup, which
refuses a token not shaped like our keys, or a key it recently found unknown, without a
database read.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.auth.bearer_keys import bearer_token
from gateway.auth.key_cache import KeyCache
from gateway.errors import ApiError
from gateway.storage import api_keys
from policies.decision import Rejection

Endpoint = Callable[[Request], Awaitable[Response]]
CREDENTIAL_ID_LENGTH = 12  # hex digits of the key's SHA-256: 48 bits, no help to a guesser


def admin_credential_id(admin_key_hash: str) -> str:
    """How the audit log names the admin key: ``admin-key:`` and the first hex digits of its
    SHA-256 (``admin_key_hash``), never the key. A rotated key shows as a new id."""
    return f"admin-key:{admin_key_hash.strip().lower()[:CREDENTIAL_ID_LENGTH]}"


def admin_guard(admin_key_hash: str, keys: KeyCache) -> Callable[[Endpoint], Endpoint]:
    """A decorator that lets only the admin key (``admin_key_hash``, lowercase SHA-256 hex)
    through; ``keys`` recognises tenant keys for the 403."""

    def guard(endpoint: Endpoint) -> Endpoint:
        @functools.wraps(endpoint)
        async def guarded(request: Request) -> Response:
            token = bearer_token(request)
            if token is None or not api_keys.verify_key(token, admin_key_hash):
                if token is not None and await _is_tenant_key(keys, token):
                    raise _not_an_admin_key()
                raise _invalid_admin_key()
            return await endpoint(request)

        return guarded

    return guard


async def _is_tenant_key(keys: KeyCache, token: str) -> bool:
    """Whether a token that is not the admin key is a live tenant key: one key-cache lookup
    (the cache checks the token's shape first, as on every other route); if the lookup
    fails, the answer is the plain 401."""
    try:
        await keys.key(token)
    except ApiError:
        return False
    return True


def _invalid_admin_key() -> ApiError:
    return ApiError(
        Rejection(
            401,
            "invalid_api_key",
            "invalid_request_error",
            "Missing or incorrect admin key: pass `Authorization: Bearer <admin key>`.",
            headers={"WWW-Authenticate": "Bearer"},
        )
    )


def _not_an_admin_key() -> ApiError:
    """A valid tenant key on the admin API: known, but not allowed here. The words follow
    OpenAI's for a key that lacks a scope ("You have insufficient permissions for this
    operation"), with the status a client library maps to ``PermissionDeniedError``."""
    return ApiError(
        Rejection(
            403,
            "insufficient_permissions",
            "permission_error",
            "You have insufficient permissions for this operation: this is a tenant API key, "
            "and the admin API needs the admin key (`Authorization: Bearer <admin key>`).",
        )
    )
