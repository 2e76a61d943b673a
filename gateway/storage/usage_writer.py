"""A durable, buffered writer of usage records.

::

    submit(entry) ──► spill file (JSONL, appended and flushed) ──► buffer ──► writer thread
                                                                               │ batches of
    start-up: replay the spill file into the buffer                            ▼ max_batch_size
                                                          insert_usage (idempotent by request_id)
                                                           ok: drop from buffer; when the buffer
                                                               is empty, truncate the spill file
                                                           down: keep everything, back off, retry

Why a thread and not an asyncio task: the database drivers are blocking, and retries may wait
for minutes while the database is down; a thread keeps all of that off the event loop.
``submit`` only takes a lock, appends a line to the spill file and to a deque, so it is safe to
call from the event loop (or any thread) and never waits for the database.

Invariant: every accepted record is in the spill file until it has been committed to the
database. The file is truncated only when nothing is pending, so a crash at any point loses
nothing; records committed just before a crash are replayed, and ``insert_usage`` ignores them.
Appends are flushed to the OS at once (a process crash is safe) and fsynced before each batch
is written (a machine crash loses at most the records accepted since the last batch, which
``linger_s`` bounds: 0.2 s by default).

A record the database refuses as invalid (integrity or data error) would block every record
behind it: it is moved to ``<spill>.rejected.jsonl`` and logged instead. Any other error (the
database down, tables not migrated yet) is retried with backoff until it succeeds.

One writer per spill file: the file is locked while a writer has it open, and a second
writer is refused with :class:`SpillFileHeldError`.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from collections import deque
from itertools import islice
from pathlib import Path
from typing import IO

import orjson
from sqlalchemy.exc import DataError, IntegrityError, SQLAlchemyError

from gateway.storage.database import Database
from gateway.storage.usage_store import UsageEntry, insert_usage

logger = logging.getLogger(__name__)


class SpillFileHeldError(RuntimeError):
    """Another writer (another gateway on the same data directory) holds the spill file:
    two writers would replay and truncate each other's records."""

    def __init__(self, spill_path: Path) -> None:
        super().__init__(
            f"{spill_path} is held by another gateway (its usage spill file is locked): "
            "stop that gateway first, or give this one another data directory"
        )
        self.spill_path = spill_path


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
        # transaction (and one fsync) carries many records instead of one each. A commit
        # costs ~0.6 ms of CPU (most of it holding the GIL the event loop needs) whatever
        # its size: at 50 requests/s a 20 ms linger meant one commit per request. Records are
        # durable in the spill file meanwhile; only their arrival in the database waits,
        # and `flush` cuts the wait short.
        self._linger_s = linger_s
        self._num_flush_waiters = 0
        self._buffer: deque[UsageEntry] = deque()
        self._cond = threading.Condition()
        self._is_closing = False
        self._thread: threading.Thread | None = None
        self.num_written = 0  # records committed by this writer (replays of stored ones included)
        self.num_rejected = 0
        spill_path.parent.mkdir(parents=True, exist_ok=True)
        self._spill: IO[str] = open(spill_path, "a+", encoding="utf-8")  # noqa: SIM115
        try:
            fcntl.flock(self._spill.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._spill.close()
            raise SpillFileHeldError(spill_path) from exc
        self._num_spilled_lines = self._replay()

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

    def submit(self, entry: UsageEntry) -> None:
        """Accept a record: durable in the spill file on return, written to the database later."""
        line = orjson.dumps(entry.to_json_dict()).decode() + "\n"
        with self._cond:
            if self._spill.closed:
                raise RuntimeError("the usage writer is closed: close it after the server drains")
            self._spill.write(line)
            self._spill.flush()
            self._num_spilled_lines += 1
            self._buffer.append(entry)
            # Wake the writer only when it has something to act on: the first record (it
            # waits for one) and a full batch (it lingers for one). A wake-up per record
            # would make the writer thread take the GIL from the event loop every request.
            if len(self._buffer) == 1 or len(self._buffer) == self._max_batch_size:
                self._cond.notify_all()

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
        if self._spill.closed:
            return not self._buffer
        is_flushed = self.flush(timeout) if self._thread is not None else not self._buffer
        with self._cond:
            self._is_closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(timeout, 1.0))
        with self._cond:
            self._spill.flush()
            os.fsync(self._spill.fileno())
            self._spill.close()  # also releases the lock
        return is_flushed

    def _replay(self) -> int:
        self._spill.seek(0)
        num_lines = 0
        line = ""
        for line_number, line in enumerate(self._spill, start=1):
            num_lines += 1
            try:
                self._buffer.append(UsageEntry.from_json_dict(json.loads(line)))
            except (ValueError, TypeError, KeyError) as exc:
                # A torn last line from a crash mid-append; anything else is worth a look.
                logger.warning(
                    "skipping unreadable line %d of %s: %s", line_number, self._spill_path, exc
                )
        if line and not line.endswith("\n"):
            self._spill.write("\n")  # end the torn line, or the next append would join it
            self._spill.flush()
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
                self._spill.flush()
                spill_fd = self._spill.fileno()
            # fsync outside the lock: submit() (on the event loop) must never wait on a disk.
            os.fsync(spill_fd)
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
        logger.error(
            "database refused usage record %s; kept in %s", entry.request_id, self._rejected_path
        )
        with open(self._rejected_path, "a", encoding="utf-8") as rejected:
            rejected.write(json.dumps(entry.to_json_dict()) + "\n")
            rejected.flush()
            os.fsync(rejected.fileno())

    def _done(self, num_records: int, num_rejected: int) -> None:
        with self._cond:
            if self._spill.closed:  # closed while this batch was in flight: replayed next time
                return
            for _ in range(num_records):
                self._buffer.popleft()
            self.num_written += num_records - num_rejected
            self.num_rejected += num_rejected
            if not self._buffer:
                self._spill.truncate(0)
                self._num_spilled_lines = 0
            elif self._num_spilled_lines > max(self._compact_after_lines, 2 * len(self._buffer)):
                self._compact()
            self._cond.notify_all()

    def _compact(self) -> None:
        """Rewrite the spill file with only the pending records (caller holds the lock)."""
        tmp_path = self._spill_path.with_name(self._spill_path.name + ".tmp")
        with open(tmp_path, "w", encoding="utf-8") as tmp:
            for entry in self._buffer:
                tmp.write(json.dumps(entry.to_json_dict(), separators=(",", ":")) + "\n")
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_path, self._spill_path)
        old = self._spill
        self._spill = open(self._spill_path, "a+", encoding="utf-8")  # noqa: SIM115
        fcntl.flock(self._spill.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        old.close()
        self._num_spilled_lines = len(self._buffer)
