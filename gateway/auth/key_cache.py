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

An unknown key costs at most one database read per ``unknown_ttl_s``. A token not shaped
like our keys (``api_keys.is_well_shaped``, the one rule the admin API's guard shares through
this cache) is refused before any lookup, unread. A well-shaped key the database does not
know is remembered, by its hash only, with the key set's epoch (``epochs``) read before that
read, for ``unknown_ttl_s`` (least recently refused first out beyond ``max_unknown``); each
distinct made-up key still costs its first read::

    unknown, younger than unknown_ttl_s ─► key set's epoch still the one read before? ─► 401
                                                        │ changed (a key was created)
                                                        ▼
                                                   read the database

A key created through the admin API therefore works at once, on this gateway and on every
replica sharing the epoch store: creating it bumps its tenant's epoch and with it the key
set's, after the commit (the same order, and the same guarantee, as a revocation). Only a
key written straight into the database waits out ``unknown_ttl_s`` (as a change made there
waits out ``ttl_s``). An epoch store that cannot answer leaves the remembered refusals unused:
the key is read from the database, as it was before.

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
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import anyio
from sqlalchemy.exc import SQLAlchemyError

from gateway.auth.bearer_keys import Caller, auth_unavailable, caller_of
from gateway.auth.epochs import INITIAL_EPOCH, AuthEpochs
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
DEFAULT_MAX_UNKNOWN = 100_000  # remembered refusals: some tens of MB at most


@dataclass(frozen=True)
class CachedKey:
    caller: Caller
    key_hash: str = field(repr=False)
    epoch: str  # the tenant's auth epoch, read before the key was
    expires_at: float | None  # unix seconds
    loaded_at: float  # the cache's clock: read again ttl_s after this
    verified_at: float  # the cache's clock: when the database last confirmed the key


@dataclass(frozen=True)
class UnknownKey:
    """A well-shaped key the database did not know (kept under its hash only)."""

    key_set: str  # the key set's epoch, read before the database was
    refused_at: float  # the cache's clock


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
        max_unknown: int = DEFAULT_MAX_UNKNOWN,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        if stale_ttl_s < 0:
            raise ValueError(f"stale_ttl_s must be >= 0, got {stale_ttl_s}")
        if unknown_ttl_s < 0:
            raise ValueError(f"unknown_ttl_s must be >= 0, got {unknown_ttl_s}")
        if max_unknown < 1:
            raise ValueError(f"max_unknown must be >= 1, got {max_unknown}")
        self._database = database
        self._epochs = epochs
        self._ttl_s = ttl_s
        self._stale_ttl_s = stale_ttl_s
        self._epochs_fail_open = epochs_fail_open
        self._trust_s = max(ttl_s, stale_ttl_s)  # the longest any entry stands in memory
        self._max_entries = max_entries
        self._unknown_ttl_s = unknown_ttl_s
        self._max_unknown = max_unknown
        self._clock = clock
        self._wall_clock = wall_clock
        self._entries: dict[str, CachedKey] = {}
        self._reads: dict[str, asyncio.Future[CachedKey]] = {}  # by key hash: misses in flight
        self._unknown: OrderedDict[str, UnknownKey] = OrderedDict()  # by key hash, LRU first

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_unknown(self) -> int:
        """How many refused keys are remembered now."""
        return len(self._unknown)

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
        elif await self._is_known_unknown(key_hash):
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
            key_set = await self._key_set()
            found = await self._read(key_hash)
            if found is None:
                self._remember_unknown(key_hash, key_set)
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

    async def _is_known_unknown(self, key_hash: str) -> bool:
        """Whether the key was refused less than ``unknown_ttl_s`` ago and no key was created
        (the key set's epoch unchanged) since the read that refused it."""
        unknown = self._unknown.get(key_hash)
        if unknown is None:
            return False
        if self._clock() - unknown.refused_at < self._unknown_ttl_s:
            key_set = await self._key_set()
            if key_set is not None and key_set == unknown.key_set:
                if key_hash in self._unknown:
                    self._unknown.move_to_end(key_hash)
                return True
        if self._unknown.get(key_hash) is unknown:
            del self._unknown[key_hash]
        return False

    def _remember_unknown(self, key_hash: str, key_set: str | None) -> None:
        if key_set is None or self._unknown_ttl_s == 0:
            return
        self._unknown.pop(key_hash, None)
        if len(self._unknown) >= self._max_unknown:
            self._unknown.popitem(last=False)
        self._unknown[key_hash] = UnknownKey(key_set, self._clock())

    async def _key_set(self) -> str | None:
        """The key set's epoch, or ``None`` if the epoch store cannot answer (then no refusal
        is remembered or trusted: the database answers, as without this cache)."""
        if self._unknown_ttl_s == 0:
            return None
        try:
            return await self._epochs.key_set()
        except Exception as exc:
            logger.debug("key set epoch unreadable (%s): reading the database", exc)
            return None

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
