"""A durable, buffered writer of usage records.

::

    accept(entry) ─► spill file (JSONL, appended whole) ─► buffer ─► writer thread
         │ awaits                                                      │ batches of
         ▼                                                             ▼ max_batch_size
    group_fsync: one fsync for every record          insert_usage (idempotent by request_id)
    appended since the last (its own thread)           ok: drop from buffer; when the buffer
         │ the file refused (disk full, read-only,         is empty, truncate the spill file
         ▼ size limit) or the fsync failed              down: keep everything, back off, retry
    the record inserted straight into the database
         │ that failed too
         ▼
    RecordNotAccepted: the request's answer becomes a 503     start-up: replay the spill
                                                              file into the buffer

Why threads and not asyncio tasks: the database drivers are blocking, and retries may wait
for minutes while the database is down; fsync may wait on a disk. Threads keep all of that
off the event loop. ``submit`` only takes a lock and appends a line to the spill file and to
a deque, so it is safe to call from the event loop (or any thread) and never waits.

Invariant: a record is accepted only once it is durable, fsynced in the spill file or
committed to the database (`accept` returns), and every record in the spill file stays there
until it has been committed to the database. The file is truncated only when nothing is
pending, so a crash at any point loses nothing accepted; records committed just before a
crash are replayed, and ``insert_usage`` ignores them. A request's answer completes only
after its record is accepted (`gateway.accounting.settlement`), so no answer goes out
without its record, even on a full disk.

A record the spill file refuses is never appended later (`gateway.storage.spill_file`: an
append lands whole or not at all). While the file refuses, ``spill_is_writable`` is false
(``/ready`` answers 503 so load balancers move traffic away); it probes the file again at
most every ``PROBE_INTERVAL_S``, so the writer notices the disk has room again without a
request having to fail first. A record whose append succeeded but whose fsync failed is in
the buffer and reaches the database like any other (`RecordNotAccepted.is_kept`).

A record the database refuses as invalid (integrity or data error) would block every record
behind it: it is moved to ``<spill>.rejected.jsonl`` and logged instead. Any other error (the
database down, tables not migrated yet) is retried with backoff until it succeeds.

One writer per spill file: the file is locked while a writer has it open, and a second
writer is refused with :class:`SpillFileHeldError`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import deque
from itertools import islice
from pathlib import Path

import anyio
import orjson
from sqlalchemy.exc import DataError, IntegrityError, SQLAlchemyError

from gateway.storage.database import Database
from gateway.storage.group_fsync import GroupFsync
from gateway.storage.spill_file import SpillFile, SpillFileHeldError
from gateway.storage.usage_store import UsageEntry, insert_usage

__all__ = ["PROBE_INTERVAL_S", "RecordNotAccepted", "SpillFileHeldError", "UsageWriter"]

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0  # a spill file that refused is tried again at most this often


class RecordNotAccepted(Exception):
    """Neither the spill file nor the database took the record. ``is_kept``: it was appended
    (only its fsync failed), so it is in the buffer and will still reach the database:
    whoever settles money for it must count it; otherwise it is gone."""

    def __init__(self, request_id: str, *, is_kept: bool) -> None:
        super().__init__(f"usage record {request_id} was not accepted (kept: {is_kept})")
        self.is_kept = is_kept


class UsageWriter:
    def __init__(
        self,
        database: Database,
        spill_path: Path,
        *,
        max_batch_size: int = 500,
        initial_backoff_s: float = 0.1,
        max_backoff_s: float = 10.0,
        compact_after_lines: int = 10_000,
        linger_s: float = 0.2,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if not 0 < initial_backoff_s <= max_backoff_s:
            raise ValueError("backoff must satisfy 0 < initial_backoff_s <= max_backoff_s")
        self._database = database
        self._spill_path = spill_path
        self._rejected_path = spill_path.with_name(spill_path.name + ".rejected.jsonl")
        self._max_batch_size = max_batch_size
        self._initial_backoff_s = initial_backoff_s
        self._max_backoff_s = max_backoff_s
        self._compact_after_lines = compact_after_lines
        # Wait this long for more records before committing a part-full batch, so one
        # transaction carries many records instead of one each. A commit costs ~0.6 ms of
        # CPU (most of it holding the GIL the event loop needs) whatever its size: at 50
        # requests/s a 20 ms linger meant one commit per request. Records are durable in the
        # spill file meanwhile; only their arrival in the database waits, and `flush` cuts
        # the wait short.
        self._linger_s = linger_s
        self._num_flush_waiters = 0
        self._buffer: deque[UsageEntry] = deque()
        self._cond = threading.Condition()
        self._is_closing = False
        self._thread: threading.Thread | None = None
        self.num_written = 0  # records committed by this writer (replays of stored ones included)
        self.num_rejected = 0
        self.num_written_directly = 0  # records the spill file refused, committed at once
        self._refused_since: float | None = None  # the spill file's last refusal, until a probe
        self._last_probe_at = 0.0
        self._database_refused_at: float | None = None  # the last direct write's failure
        spill_path.parent.mkdir(parents=True, exist_ok=True)
        self._spill = SpillFile(spill_path)
        self._num_spilled_lines = self._replay()
        self._group_fsync = GroupFsync(lambda: self._spill.sync(), self._refused)

    @property
    def num_pending(self) -> int:
        with self._cond:
            return len(self._buffer)

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("the usage writer is already started")
            self._thread = threading.Thread(target=self._run, name="usage-writer", daemon=True)
            self._thread.start()
            self._group_fsync.start()

    async def accept(self, entry: UsageEntry) -> None:
        """Make the record durable: appended to the spill file and fsynced (shared with every
        record appended meanwhile), else committed straight to the database. Raises
        `RecordNotAccepted` when neither could take it."""
        try:
            self.submit(entry)
        except (OSError, RuntimeError):  # refused, or the writer closed (shutting down)
            if await self._write_directly(entry):
                return
            raise RecordNotAccepted(entry.request_id, is_kept=False) from None
        if await self._group_fsync.synced() or await self._write_directly(entry):
            return
        raise RecordNotAccepted(entry.request_id, is_kept=True)

    def submit(self, entry: UsageEntry) -> None:
        """Append a record to the spill file and the buffer (written to the database later).
        Raises ``OSError`` when the spill file refuses it: it is then not taken at all.
        Durable against a process crash on return, against a machine crash once fsynced."""
        line = orjson.dumps(entry.to_json_dict()) + b"\n"
        with self._cond:
            if self._spill.is_closed:
                raise RuntimeError("the usage writer is closed: close it after the server drains")
            try:
                self._spill.append(line)
            except OSError as exc:
                self._refused(exc)
                raise
            self._refused_since = None
            self._num_spilled_lines += 1
            self._buffer.append(entry)
            # Wake the writer only when it has something to act on: the first record (it
            # waits for one) and a full batch (it lingers for one). A wake-up per record
            # would make the writer thread take the GIL from the event loop every request.
            if len(self._buffer) == 1 or len(self._buffer) == self._max_batch_size:
                self._cond.notify_all()

    def spill_is_writable(self) -> bool:
        """Whether the spill file takes records: after a refusal, false until a probe (at
        most every ``PROBE_INTERVAL_S``, made by this call) finds room again."""
        if self._refused_since is None:
            return True
        now = time.monotonic()
        if now - self._last_probe_at < PROBE_INTERVAL_S:
            return False
        self._last_probe_at = now
        with self._cond:
            if self._spill.is_closed:
                return False
            try:
                self._spill.probe()
            except OSError:
                return False
            self._refused_since = None
        logger.warning("the usage spill file %s takes records again", self._spill_path)
        return True

    def takes_records(self) -> bool:
        """False only while the spill file refuses and the database refused a record within
        the last ``PROBE_INTERVAL_S``: a request then is refused before an engine works for
        an answer it could not give. Otherwise the next record is tried."""
        if self.spill_is_writable():
            return True
        refused_at = self._database_refused_at
        return refused_at is None or time.monotonic() - refused_at >= PROBE_INTERVAL_S

    def flush(self, timeout: float) -> bool:
        """Wait until every accepted record is in the database; ``False`` on timeout."""
        with self._cond:
            self._num_flush_waiters += 1
            self._cond.notify_all()  # the writer stops lingering
            try:
                return self._cond.wait_for(lambda: not self._buffer, timeout)
            finally:
                self._num_flush_waiters -= 1

    def close(self, timeout: float) -> bool:
        """Write what is pending (up to ``timeout``), then stop.

        Returns ``False`` if records were still pending: they stay in the spill file and are
        written by the next writer started on it.
        """
        if self._spill.is_closed:
            return not self._buffer
        is_flushed = self.flush(timeout) if self._thread is not None else not self._buffer
        with self._cond:
            self._is_closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(timeout, 1.0))
        self._group_fsync.close(timeout=max(timeout, 1.0))
        with self._cond:
            self._spill.close()  # fsyncs; also releases the lock
        return is_flushed

    def _refused(self, exc: OSError) -> None:
        if self._refused_since is None:
            logger.error(
                "the usage spill file %s refuses records (%s): requests whose record the "
                "database does not take at once are answered 503 until it has room",
                self._spill_path,
                exc,
            )
            self._refused_since = time.monotonic()
            self._last_probe_at = self._refused_since

    async def _write_directly(self, entry: UsageEntry) -> bool:
        """Commit one record at once (the spill file refused it); ``False`` if that failed."""
        try:
            await anyio.to_thread.run_sync(self._write, [entry])
        except SQLAlchemyError as exc:
            logger.error(
                "usage record %s: the database refused it too (%s)",
                entry.request_id,
                type(exc).__name__,
            )
            self._database_refused_at = time.monotonic()
            return False
        self._database_refused_at = None
        with self._cond:
            self.num_written_directly += 1
        return True

    def _replay(self) -> int:
        num_lines = 0
        for line_number, line in enumerate(self._spill.lines(), start=1):
            num_lines += 1
            try:
                self._buffer.append(UsageEntry.from_json_dict(json.loads(line)))
            except (ValueError, TypeError, KeyError) as exc:
                # A record the database would refuse; a torn line is never returned.
                logger.warning(
                    "skipping unreadable line %d of %s: %s", line_number, self._spill_path, exc
                )
        if self._buffer:
            logger.info("replaying %d usage records from %s", len(self._buffer), self._spill_path)
        return num_lines

    def _run(self) -> None:
        backoff_s = self._initial_backoff_s
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._buffer) or self._is_closing)
                if self._is_closing:
                    return
                self._cond.wait_for(
                    lambda: (
                        len(self._buffer) >= self._max_batch_size
                        or self._num_flush_waiters > 0
                        or self._is_closing
                    ),
                    self._linger_s,
                )
                if self._is_closing:
                    return
                batch = list(islice(self._buffer, self._max_batch_size))
            # Records `submit`ted without `accept` (refusals) are fsynced here at the latest.
            with contextlib.suppress(OSError):  # `accept` reports a failing fsync
                self._spill.sync()
            try:
                num_rejected = self._write(batch)
            except SQLAlchemyError as exc:
                logger.warning(
                    "usage write of %d records failed (%s); retrying in %.1fs, %d pending",
                    len(batch),
                    type(exc).__name__,
                    backoff_s,
                    self.num_pending,
                )
                with self._cond:
                    self._cond.wait_for(lambda: self._is_closing, backoff_s)
                backoff_s = min(backoff_s * 2, self._max_backoff_s)
                continue
            backoff_s = self._initial_backoff_s
            self._done(len(batch), num_rejected)

    def _write(self, batch: list[UsageEntry]) -> int:
        """Commit the batch; returns how many records were rejected as invalid."""
        try:
            with self._database.transaction() as session:
                insert_usage(session, batch)
        except (IntegrityError, DataError):
            if len(batch) == 1:
                self._reject(batch[0])
                return 1
            # Find the bad record one by one; any other error propagates and is retried.
            return sum(self._write([entry]) for entry in batch)
        return 0

    def _reject(self, entry: UsageEntry) -> None:
        record = json.dumps(entry.to_json_dict())
        logger.error(
            "database refused usage record %s; kept in %s", entry.request_id, self._rejected_path
        )
        try:
            with open(self._rejected_path, "a", encoding="utf-8") as rejected:
                rejected.write(record + "\n")
                rejected.flush()
                os.fsync(rejected.fileno())
        except OSError as exc:  # the disk full too: the log keeps it
            logger.error("could not keep refused usage record (%s): %s", exc, record)

    def _done(self, num_records: int, num_rejected: int) -> None:
        with self._cond:
            if self._spill.is_closed:  # closed while this batch was in flight: replayed next time
                return
            for _ in range(num_records):
                self._buffer.popleft()
            self.num_written += num_records - num_rejected
            self.num_rejected += num_rejected
            try:
                if not self._buffer:
                    self._spill.truncate()
                    self._num_spilled_lines = 0
                elif self._num_spilled_lines > max(
                    self._compact_after_lines, 2 * len(self._buffer)
                ):
                    self._compact()
            except OSError as exc:  # the file keeps written records: replayed, then ignored
                logger.warning("could not shrink the usage spill file: %s", exc)
            self._cond.notify_all()

    def _compact(self) -> None:
        """Rewrite the spill file with only the pending records (caller holds the lock)."""
        self._spill.replace(orjson.dumps(entry.to_json_dict()) for entry in self._buffer)
        self._num_spilled_lines = len(self._buffer)
