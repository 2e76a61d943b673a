"""API keys from memory: key hash -> (tenant, key, quota), safe against revocation.

An entry keeps the tenant's auth epoch (``epochs``) as read *before* the key was read
from the database. Every request's admission step compares that epoch with the current one
(in the same Redis call that counts it), so a key revoked or a quota changed through the
admin API of any replica is seen by the next request everywhere::

    hit:  hash -> entry (not expired, younger than ttl_s) ──► admission checks entry.epoch
    miss: read key (its tenant) ─► read epoch ─► read key again ─► cache (key, epoch)
    admission saw epoch E' instead: ``reload``: read key (after E' was read) ─► cache (key, E')

Reading the epoch before the key means a change committed before that epoch's bump is always
in what was read; a change committed after it bumps the epoch again. Revoked and expired keys
are never cached, and an entry's key expiry is checked on every use.

A made-up key costs no database read. A token not shaped like our keys
(``api_keys.is_well_shaped``, the one rule the admin API's guard shares through this cache) is
refused before any lookup. A well-shaped key with no entry is first looked up in the filter of
the keys that exist (``known_key_filter``, 8 bytes a key): one it does not hold is refused
unread; one it holds goes on to the read below (revoked and expired keys are in the filter, and
that read refuses them as ever). The filter is read again, in one incremental query shared by
concurrent misses, when the key set's epoch (``epochs``) moved since its last read: creating a
key through the admin API bumps it after the commit, so the new key works at once on every
gateway sharing the epoch store. A key written straight into the database, or created while
the epoch store cannot answer, waits at most ``unknown_ttl_s`` (see the filter's docstring).
``unknown_ttl_s == 0`` turns the filter off: every key without an entry is read.

Keys exist here only as their SHA-256. Like the database's index, the dict finds an entry by
that hash: a timing difference could only tell how much of the SHA-256 of a caller's own
guess matches a stored one, which does not help find a key (the database path still compares
in constant time). ``ttl_s`` bounds how long a change made without the admin API (straight in
the database) can go unseen; ``ttl_s == 0`` reads the database on every request.

Concurrent misses for one key share one read (unless ``ttl_s == 0``): the first starts it,
the others wait for its answer (or its error). A gateway that starts, or a key whose entry
ages out, under a burst of its requests would otherwise send the whole burst to the database
at once, and a burst larger than the connection pool then fails its waits with 503s.

The database unreachable (serve-stale-on-error): an entry older than ``ttl_s`` is read again;
if that read fails (the database, not the key: a key found revoked or missing is refused at
once) and the tenant's epoch is the one the entry holds, the entry keeps working until
``stale_ttl_s`` after the database last confirmed it, and the database is tried again after
another ``ttl_s``. A tenant whose epoch changed (a key revoked or a quota changed through the
admin API before the outage, wherever Redis is up) and a key never seen get a 503 instead::

    older than ttl_s ─► epoch ─► read key ─ok─► cache (verified now)
                                   │ database error
                                   ▼
         same epoch and verified < stale_ttl_s ago ─► serve the entry (retry after ttl_s)
         otherwise ─────────────────────────────────► 503 auth_unavailable

With ``epochs_fail_open`` (``redis_failure_mode: open``), an epoch store that cannot answer
is read as ``INITIAL_EPOCH``: the key is still read from the database, and the admission step
reloads it once the store answers with the real epoch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import anyio
from sqlalchemy.exc import SQLAlchemyError

from gateway.auth.bearer_keys import Caller, auth_unavailable, caller_of
from gateway.auth.epochs import INITIAL_EPOCH, AuthEpochs
from gateway.auth.known_key_filter import KnownKeyFilter
from gateway.errors import ApiError, invalid_api_key
from gateway.storage.api_keys import (
    AuthenticatedKey,
    authenticate_hash,
    hash_key,
    is_well_shaped,
)
from gateway.storage.database import Database

logger = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = 100_000


@dataclass(frozen=True)
class CachedKey:
    caller: Caller
    key_hash: str = field(repr=False)
    epoch: str  # the tenant's auth epoch, read before the key was
    expires_at: float | None  # unix seconds
    loaded_at: float  # the cache's clock: read again ttl_s after this
    verified_at: float  # the cache's clock: when the database last confirmed the key


class KeyCache:
    def __init__(
        self,
        database: Database,
        epochs: AuthEpochs,
        *,
        ttl_s: float,
        stale_ttl_s: float = 0.0,
        epochs_fail_open: bool = False,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        unknown_ttl_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        if stale_ttl_s < 0:
            raise ValueError(f"stale_ttl_s must be >= 0, got {stale_ttl_s}")
        if unknown_ttl_s < 0:
            raise ValueError(f"unknown_ttl_s must be >= 0, got {unknown_ttl_s}")
        self._database = database
        self._epochs = epochs
        self._ttl_s = ttl_s
        self._stale_ttl_s = stale_ttl_s
        self._epochs_fail_open = epochs_fail_open
        self._trust_s = max(ttl_s, stale_ttl_s)  # the longest any entry stands in memory
        self._max_entries = max_entries
        self._clock = clock
        self._wall_clock = wall_clock
        self._entries: dict[str, CachedKey] = {}
        self._reads: dict[str, asyncio.Future[CachedKey]] = {}  # by key hash: misses in flight
        self.known_keys: KnownKeyFilter | None = None
        if unknown_ttl_s > 0:
            self.known_keys = KnownKeyFilter(
                database, epochs, window_s=unknown_ttl_s, clock=clock, wall_clock=wall_clock
            )

    def __len__(self) -> int:
        return len(self._entries)

    async def key(self, token: str) -> CachedKey:
        """The active key for a presented bearer token; a 401 if there is none (a 503 if the
        database or the epoch store cannot answer and no stale entry may stand in)."""
        if not is_well_shaped(token):
            raise invalid_api_key()
        key_hash = hash_key(token)
        entry = self._entries.get(key_hash)
        if entry is not None:
            now = self._clock()
            if now - entry.loaded_at < self._ttl_s and now - entry.verified_at < self._trust_s:
                return self._unexpired(key_hash, entry)
        elif self.known_keys is not None and not await self.known_keys.may_hold(key_hash):
            raise invalid_api_key()
        if self._ttl_s == 0:  # every request reads for itself: none joins an earlier read
            return await self._refresh(key_hash, entry)
        read = self._reads.get(key_hash)
        if read is None:
            read = asyncio.ensure_future(self._refresh(key_hash, entry))
            self._reads[key_hash] = read
            read.add_done_callback(lambda done: self._read_done(key_hash, done))
        # Shielded: a caller that leaves (its client gone) does not cancel the others' read.
        return await asyncio.shield(read)

    def _read_done(self, key_hash: str, read: asyncio.Future[CachedKey]) -> None:
        self._reads.pop(key_hash, None)
        if not read.cancelled():
            read.exception()  # retrieved here too: every caller may have left before it ended

    async def _refresh(self, key_hash: str, entry: CachedKey | None) -> CachedKey:
        """The miss path of `key`: read the key (and its tenant's epoch) from the stores."""
        tenant_id = entry.caller.tenant_id if entry is not None else None
        if tenant_id is None:  # a key's tenant never changes: only a first sight reads it
            found = await self._read(key_hash)
            if found is None:
                raise invalid_api_key()
            tenant_id = found.tenant.id
        epoch = await self._current_epoch(tenant_id)
        try:
            return await self._load(key_hash, epoch)
        except SQLAlchemyError as exc:
            if entry is None or not self._may_stand_in(entry, epoch):
                raise auth_unavailable(exc) from None
            logger.warning(
                "database unreachable (%s): key %s of tenant %s served from a cache entry "
                "verified %.0f s ago",
                type(exc).__name__,
                entry.caller.key_id,
                tenant_id,
                self._clock() - entry.verified_at,
            )
            stale = replace(entry, loaded_at=self._clock())  # the database again after ttl_s
            self._entries[key_hash] = stale
            return self._unexpired(key_hash, stale)

    async def reload(self, entry: CachedKey, epoch: str) -> CachedKey:
        """The key as the database has it after ``epoch`` was read (the admission step saw the
        tenant's epoch change to it); a 401 if it is no longer active, a 503 if the database
        cannot answer (the change may be a revocation: no stale entry stands in)."""
        try:
            return await self._load(entry.key_hash, epoch)
        except SQLAlchemyError as exc:
            raise auth_unavailable(exc) from None

    def _may_stand_in(self, entry: CachedKey, epoch: str) -> bool:
        """Whether a cached entry may answer for a database that failed to."""
        fresh_enough = self._clock() - entry.verified_at < self._stale_ttl_s
        return fresh_enough and epoch == entry.epoch

    def _unexpired(self, key_hash: str, entry: CachedKey) -> CachedKey:
        if entry.expires_at is not None and self._wall_clock() >= entry.expires_at:
            del self._entries[key_hash]
            raise invalid_api_key()
        return entry

    async def _load(self, key_hash: str, epoch: str) -> CachedKey:
        """Raises ``SQLAlchemyError`` if the database cannot answer."""
        found = await self._read_or_raise(key_hash)
        if found is None:
            self._entries.pop(key_hash, None)
            raise invalid_api_key()
        expires_at = found.key.expires_at
        now = self._clock()
        entry = CachedKey(
            caller=caller_of(found),
            key_hash=key_hash,
            epoch=epoch,
            expires_at=None if expires_at is None else expires_at.timestamp(),
            loaded_at=now,
            verified_at=now,
        )
        if self._trust_s > 0:  # with ttl_s == 0, kept only to stand in for a failed database
            self._entries.pop(key_hash, None)  # re-inserted last: evicted last
            if len(self._entries) >= self._max_entries:
                del self._entries[next(iter(self._entries))]
            self._entries[key_hash] = entry
        return entry

    async def _read(self, key_hash: str) -> AuthenticatedKey | None:
        try:
            return await self._read_or_raise(key_hash)
        except SQLAlchemyError as exc:
            raise auth_unavailable(exc) from None

    async def _read_or_raise(self, key_hash: str) -> AuthenticatedKey | None:
        def lookup() -> AuthenticatedKey | None:
            with self._database.session() as session:
                return authenticate_hash(session, key_hash)

        return await anyio.to_thread.run_sync(lookup)

    async def _current_epoch(self, tenant_id: str) -> str:
        try:
            return await self._epochs.current(tenant_id)
        except ApiError:
            raise
        except Exception as exc:  # Redis down: the same answer as a database outage
            if self._epochs_fail_open:
                logger.warning("auth epoch unreadable (%s): reading the key alone", exc)
                return INITIAL_EPOCH
            raise auth_unavailable(exc) from None
