"""Which keys exist, 8 bytes a key: a made-up key is refused without a database read.

The key cache (``key_cache``) asks this filter about a well-shaped key it holds no entry for.
The filter keeps ``hash_prefix`` (the first 8 bytes of the SHA-256) of every key row, sorted in
an ``array('Q')`` and searched with ``bisect``. A prefix it does not hold is a key that does not
exist: 401, unread. A prefix it holds only means "maybe": the key goes on to the cache's usual
read, so a prefix shared by two keys (about n / 2**64 for a made-up key among n) costs a read,
never a wrong answer. Revoked and expired keys stay in the filter: the read refuses them.

Memory: 8 bytes a key, 8 MB at 1M keys (and some 50 MB more for a moment while the first load
sorts them; a later refresh copies the 8 MB array once, and only if it found a new key).

When the filter is read again (one query, shared by every miss that waits for it, and
incremental after the first: only the rows created since ``CREATED_AT_OVERLAP`` before the last
load began, by this gateway's clock)::

    miss ─► filter never loaded ─────────────────────────────────► load everything
         ─► key set's epoch (``epochs``) not the one read before the last load ─► refresh
         ─► unchanged, or the epoch store cannot answer:
              fewer than MAX_UNPROMPTED_REFRESHES refreshes in the last window_s ─► refresh
              otherwise ─────────────────────────────────────────► 401 unread

A key created through the admin API therefore works at once on every gateway sharing the epoch
store: its creation bumps the key set's epoch after the commit, so the next miss anywhere
reads the rows that commit wrote (the epoch was read before that read). A key written straight
into the database (no bump), or created while the epoch store cannot answer, works at once
unless made-up keys have used the window's refreshes; it then waits at most ``window_s``. A
flood of made-up keys thus costs each gateway at most MAX_UNPROMPTED_REFRESHES small reads per
``window_s``, whatever the number of distinct keys.

The overlap covers a creation's commit landing after a load that began before it, and the
gateways' clocks disagreeing (``created_at`` is the creating gateway's clock), up to a minute
together. A key row written with an older ``created_at`` than that is seen after a restart.

A refresh that fails (the database unreachable) keeps the filter it had and answers "maybe":
the key is read as without a filter, and that read's failure is the cache's 503
auth_unavailable, never a 401 for a key that may exist.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import partial
from heapq import merge

import anyio
from sqlalchemy.exc import SQLAlchemyError

from gateway.auth.epochs import AuthEpochs
from gateway.storage.api_keys import hash_prefix, key_hash_prefixes
from gateway.storage.database import Database

logger = logging.getLogger(__name__)

CREATED_AT_OVERLAP = timedelta(minutes=1)
MAX_UNPROMPTED_REFRESHES = 4  # per window_s: a few keys created out of band work at once
_MAX_INSERTS = 1_000  # new keys beyond this are merged in one pass instead of one by one


@dataclass(frozen=True)
class _Refresh:
    number: int  # refreshes are numbered in the order they start
    done: asyncio.Future[bool]  # True if the filter was read


class KnownKeyFilter:
    def __init__(
        self,
        database: Database,
        epochs: AuthEpochs,
        *,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._database = database
        self._epochs = epochs
        self._window_s = window_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._prefixes: array[int] | None = None  # sorted; never changed once published
        self._key_set: str | None = None  # the key set's epoch read before the last load
        self._last_load_began: datetime | None = None  # wall clock
        self._unprompted: deque[float] = deque(maxlen=MAX_UNPROMPTED_REFRESHES)  # clock
        self._in_flight: _Refresh | None = None
        self._num_refreshes = 0
        self._is_failing = False
        self.num_rows_last_read = 0

    def __len__(self) -> int:
        return 0 if self._prefixes is None else len(self._prefixes)

    async def may_hold(self, key_hash: str) -> bool:
        """``False`` only for a key that does not exist (as of the filter's last read, which
        this call may renew as the module's docstring says)."""
        prefix = hash_prefix(key_hash)
        if self._holds(prefix):
            return True
        in_flight = self._in_flight
        if in_flight is not None:
            # A read under way may bring the key (one created just before it began): wait for
            # it, at no cost to the window, before asking for another. A burst of requests
            # with a key written straight into the database otherwise spent the window's
            # refreshes while the first one was still reading, and the rest were refused.
            await asyncio.wait({in_flight.done})
            if self._holds(prefix):
                return True
        # A refresh numbered above the ticket counts as begun after this miss (the one just
        # waited for included: a key made between its start and this miss waits for the next).
        ticket = self._num_refreshes if in_flight is None else in_flight.number - 1
        key_set = await self._read_key_set()
        if not self._needs_refresh(ticket, key_set):
            return self._holds(prefix)  # a refresh may have ended meanwhile
        if not await self._refresh_after(ticket, key_set):
            return True  # the database cannot answer: the key is read as without a filter
        return self._holds(prefix)

    def _holds(self, prefix: int) -> bool:
        return self._prefixes is not None and _contains(self._prefixes, prefix)

    def _needs_refresh(self, ticket: int, key_set: str | None) -> bool:
        if self._prefixes is None:
            return True
        if key_set is not None and key_set != self._key_set:
            return True  # a key was created (or a tenant changed) since the last load
        if self._num_refreshes > ticket:  # one began after this miss: it is enough
            return self._in_flight is not None
        now = self._clock()
        is_full = len(self._unprompted) == MAX_UNPROMPTED_REFRESHES
        if is_full and now - self._unprompted[0] < self._window_s:
            return False
        self._unprompted.append(now)
        return True

    async def _refresh_after(self, ticket: int, key_set: str | None) -> bool:
        """Wait for a refresh that covers the key set's epoch ``key_set`` (read after
        ``ticket`` was taken), joining the one in flight or starting one; whether it read the
        database. A refresh covers it if it began later, or read the same epoch first."""
        while True:
            refresh = self._in_flight
            if refresh is None:
                self._num_refreshes += 1
                refresh = _Refresh(self._num_refreshes, asyncio.ensure_future(self._load()))
                self._in_flight = refresh
                refresh.done.add_done_callback(partial(self._refresh_ended, refresh))
            # Shielded: a caller that leaves (its client gone) does not cancel the others' read.
            was_read = await asyncio.shield(refresh.done)
            self._refresh_ended(refresh, refresh.done)  # (its callback may not have run yet)
            is_later = refresh.number > ticket
            if not was_read or is_later or key_set is None or key_set == self._key_set:
                return was_read

    def _refresh_ended(self, refresh: _Refresh, done: asyncio.Future[bool]) -> None:
        if self._in_flight is refresh:
            self._in_flight = None
        if not done.cancelled():
            done.exception()  # retrieved here too: every caller may have left before it ended

    async def _load(self) -> bool:
        key_set = await self._read_key_set()  # before the rows: see the module's docstring
        began = datetime.fromtimestamp(self._wall_clock(), timezone.utc)
        known = self._prefixes
        since = None
        if known is not None and self._last_load_began is not None:
            since = self._last_load_began - CREATED_AT_OVERLAP

        def read() -> tuple[array[int], int]:
            with self._database.session() as session:
                found = key_hash_prefixes(session, created_since=since)
            return _with_prefixes(known, found), len(found)

        try:
            prefixes, num_rows = await anyio.to_thread.run_sync(read)
        except SQLAlchemyError as exc:
            if not self._is_failing:
                logger.warning("known keys not read (%s): unknown keys are read", exc)
            self._is_failing = True
            return False
        self._is_failing = False
        self._prefixes, self._key_set, self._last_load_began = prefixes, key_set, began
        self.num_rows_last_read = num_rows
        return True

    async def _read_key_set(self) -> str | None:
        """The key set's epoch, or ``None`` if the epoch store cannot answer."""
        try:
            return await self._epochs.key_set()
        except Exception as exc:
            logger.debug("key set epoch unreadable (%s)", exc)
            return None


def _with_prefixes(known: array[int] | None, found: array[int]) -> array[int]:
    """``known`` (sorted) with ``found`` (any order) added: a new array, or ``known`` itself
    if nothing was new."""
    if known is None:
        return array("Q", sorted(found))
    new = sorted({prefix for prefix in found if not _contains(known, prefix)})
    if not new:
        return known
    if len(new) > _MAX_INSERTS:
        return array("Q", merge(known, new))
    prefixes = array("Q", known)
    for prefix in new:
        insort(prefixes, prefix)
    return prefixes


def _contains(prefixes: array[int], prefix: int) -> bool:
    at = bisect_left(prefixes, prefix)
    return at < len(prefixes) and prefixes[at] == prefix
