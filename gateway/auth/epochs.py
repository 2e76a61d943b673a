"""Auth epochs: one opaque token per tenant that changes whenever its keys or quota change.

The key cache (``key_cache``) remembers, with each cached key, the epoch of its tenant read
*before* the key was read from the database. The admission step compares that epoch with the
current one in the same atomic step (one Redis script) that counts the request, so a changed
epoch is seen by the first request after the change, on every replica::

    admin API: commit the change to the database ──► bump(tenant)      (in that order)
    request:   cached key + its epoch ──► admission compares epochs ──► equal: admitted
                                                       │ changed: nothing was counted
                                                       ▼
                              re-read the key (after this epoch was read), admit again

A change is therefore visible to a replica as soon as ``bump`` returns. Epochs are random
tokens, not counters, so an emptied Redis (epochs back to ``""``) can never bring back an
epoch a stale entry still holds, except ``""`` itself; the cache's TTL bounds that case and
changes made in the database without the admin API.

Beside the tenants' epochs, one epoch of the whole key set changes with every ``bump``. The
filter of the keys that exist (``known_key_filter``) keeps the key set's epoch read before its
last read of the keys, and reads the new ones when it moved: creating a key through the admin
API of any replica bumps it, so the new key works on its first request after ``bump`` returns.

Implementations: in process (one gateway, the embedded default) and Redis (any number of
replicas). The Redis key shares the tenant's hash tag with its budget and rate-limit keys.
"""

from __future__ import annotations

import secrets
from typing import Protocol
from urllib.parse import quote

from gateway.storage.redis_client import RedisCommands

INITIAL_EPOCH = ""  # a tenant whose keys and quota never changed since the store was empty


class AuthEpochs(Protocol):
    async def current(self, tenant_id: str) -> str:
        """The tenant's epoch now."""
        ...

    async def bump(self, tenant_id: str) -> None:
        """Give the tenant a new epoch, and the key set one: call it after committing a
        change to the tenant's keys (a new key included) or quota."""
        ...

    async def key_set(self) -> str:
        """The key set's epoch now: it changes whenever any tenant's does."""
        ...


def new_epoch() -> str:
    return secrets.token_hex(8)


class MemoryAuthEpochs:
    """Epochs in a dict: for one gateway whose admin API runs in the same process."""

    def __init__(self) -> None:
        self._epochs: dict[str, str] = {}
        self._key_set = INITIAL_EPOCH

    def current_now(self, tenant_id: str) -> str:
        """``current`` without awaiting (the in-process admission step reads it atomically)."""
        return self._epochs.get(tenant_id, INITIAL_EPOCH)

    async def current(self, tenant_id: str) -> str:
        return self.current_now(tenant_id)

    async def bump(self, tenant_id: str) -> None:
        self._epochs[tenant_id] = new_epoch()
        self._key_set = new_epoch()

    async def key_set(self) -> str:
        return self._key_set


KEY_SET_EPOCH_KEY = "tollway:auth:key-set:epoch"


def auth_epoch_key(tenant_id: str) -> str:
    return f"tollway:auth:{{{quote(tenant_id, safe='')}}}:epoch"


class RedisAuthEpochs:
    """``tollway:auth:{tenant}:epoch`` and ``KEY_SET_EPOCH_KEY`` (strings; absent means
    ``INITIAL_EPOCH``). A bump sets the tenant's, then the key set's (read alone, never in
    the admission script: no hash tag); if either SET fails, the admin API answers that the
    change was not announced."""

    def __init__(self, client: RedisCommands) -> None:
        self._client = client

    async def current(self, tenant_id: str) -> str:
        value = await self._client.execute_command("GET", auth_epoch_key(tenant_id))
        return INITIAL_EPOCH if value is None else _text(value)

    async def bump(self, tenant_id: str) -> None:
        await self._client.execute_command("SET", auth_epoch_key(tenant_id), new_epoch())
        await self._client.execute_command("SET", KEY_SET_EPOCH_KEY, new_epoch())

    async def key_set(self) -> str:
        value = await self._client.execute_command("GET", KEY_SET_EPOCH_KEY)
        return INITIAL_EPOCH if value is None else _text(value)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
