import asyncio
import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy.exc import IntegrityError

from gateway.storage import usage_writer
from gateway.storage.database import Database
from gateway.storage.spill_file import SpillFile
from gateway.storage.usage_store import UsageEntry, insert_usage, list_usage
from gateway.storage.usage_writer import PROBE_INTERVAL_S, RecordNotAccepted, UsageWriter
from tests.support.polling import wait_until

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def writer_db(migrated_url):
    """A handle that fails fast when the database is locked (SQLite) or refuses (PostgreSQL)."""
    db = Database(migrated_url, busy_timeout_s=0.05)
    yield db
    db.dispose()


def make_writer(db: Database, spill: Path) -> UsageWriter:
    return UsageWriter(db, spill, max_batch_size=4, initial_backoff_s=0.01, max_backoff_s=0.1)


def stored_ids(db: Database) -> list[str]:
    with db.session() as session:
        return [r.request_id for r in list_usage(session, limit=1000).records]


def test_submitted_records_are_written_and_the_spill_file_emptied(writer_db, make_entry, tmp_path):
    writer = make_writer(writer_db, tmp_path / "usage.jsonl")
    writer.start()
    for n in range(10):
        writer.submit(make_entry(n))
    assert writer.flush(timeout=10)
    assert writer.close(timeout=1)
    assert stored_ids(writer_db) == [f"req-{n}" for n in range(10)]
    assert writer.num_written == 10
    assert writer.num_pending == 0
    assert (tmp_path / "usage.jsonl").read_text() == ""


def test_a_part_full_batch_lingers_and_flush_cuts_the_linger_short(writer_db, make_entry, tmp_path):
    writer = UsageWriter(writer_db, tmp_path / "usage.jsonl", max_batch_size=100, linger_s=60)
    writer.start()
    try:
        writer.submit(make_entry(0))
        writer.submit(make_entry(1))
        time.sleep(0.3)
        assert stored_ids(writer_db) == []
        assert writer.num_pending == 2
        started = time.monotonic()
        assert writer.flush(timeout=10)
        assert time.monotonic() - started < 5  # not the 60 s linger
        assert stored_ids(writer_db) == ["req-0", "req-1"]
    finally:
        writer.close(timeout=1)


def test_a_full_batch_is_written_without_lingering(writer_db, make_entry, tmp_path):
    writer = UsageWriter(writer_db, tmp_path / "usage.jsonl", max_batch_size=3, linger_s=60)
    writer.start()
    try:
        for n in range(3):
            writer.submit(make_entry(n))
        wait_until(lambda: not writer.num_pending, 10, "the batch written")
        assert stored_ids(writer_db) == ["req-0", "req-1", "req-2"]
    finally:
        writer.close(timeout=1)


def test_records_wait_out_an_outage(writer_db, outage, make_entry, tmp_path):
    writer = make_writer(writer_db, tmp_path / "usage.jsonl")
    writer.start()
    writer.submit(make_entry(0))
    assert writer.flush(timeout=10)
    with outage():
        for n in range(1, 7):
            writer.submit(make_entry(n))
        assert not writer.flush(timeout=0.5)
        assert writer.num_pending == 6
        spilled = (tmp_path / "usage.jsonl").read_text().splitlines()
        assert [json.loads(line)["request_id"] for line in spilled] == [
            f"req-{n}" for n in range(1, 7)
        ]
    assert writer.flush(timeout=20)
    assert writer.close(timeout=1)
    assert stored_ids(writer_db) == [f"req-{n}" for n in range(7)]


def test_nothing_is_lost_when_the_process_is_killed(
    writer_db, outage, make_entry, tmp_path, migrated_url
):
    spill = tmp_path / "usage.jsonl"
    entries = [make_entry(n) for n in range(5)]
    with writer_db.transaction() as session:  # committed just before the crash, still spilled
        insert_usage(session, entries[:1])
    child = f"""
import json, os, signal, sys
from pathlib import Path
from gateway.storage.database import Database
from gateway.storage.usage_store import UsageEntry
from gateway.storage.usage_writer import UsageWriter
writer = UsageWriter(Database({migrated_url!r}, busy_timeout_s=0.05), Path({str(spill)!r}),
                     initial_backoff_s=0.01, max_backoff_s=0.05)
writer.start()
for line in sys.stdin:
    writer.submit(UsageEntry.from_json_dict(json.loads(line)))
print("accepted", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    lines = "".join(json.dumps(e.to_json_dict()) + "\n" for e in entries)
    with outage():
        result = subprocess.run(
            [sys.executable, "-c", child],
            input=lines,
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=60,
            check=False,
        )
    assert result.returncode == -9, result.stderr
    assert "accepted" in result.stdout
    with spill.open("a") as file:
        file.write('{"request_id": "req-torn", "ten')  # a torn append from the crash
    assert stored_ids(writer_db) == ["req-0"]

    writer = make_writer(writer_db, spill)
    assert writer.num_pending == 5
    writer.start()
    assert writer.flush(timeout=20)
    assert writer.close(timeout=1)
    assert stored_ids(writer_db) == [e.request_id for e in entries]


def test_close_with_the_database_down_keeps_records_for_the_next_start(
    writer_db, outage, make_entry, tmp_path
):
    spill = tmp_path / "usage.jsonl"
    with outage():
        writer = make_writer(writer_db, spill)
        writer.start()
        writer.submit(make_entry(1))
        writer.submit(make_entry(2))
        assert not writer.close(timeout=0.2)
    replayed = make_writer(writer_db, spill)
    assert replayed.num_pending == 2
    replayed.start()
    assert replayed.close(timeout=10)
    assert stored_ids(writer_db) == ["req-1", "req-2"]


def test_appends_after_a_torn_line_are_not_lost(writer_db, outage, make_entry, tmp_path):
    spill = tmp_path / "usage.jsonl"
    spill.write_text(json.dumps(make_entry(1).to_json_dict()) + '\n{"request_id": "req-to')
    with outage():
        writer = make_writer(writer_db, spill)
        writer.submit(make_entry(2))
        assert not writer.close(timeout=0)
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(make_entry(3))
    replayed = make_writer(writer_db, spill)
    assert replayed.num_pending == 2
    replayed.start()
    assert replayed.close(timeout=10)
    assert replayed.close(timeout=10)  # closing twice is harmless
    assert stored_ids(writer_db) == ["req-1", "req-2"]


def test_one_writer_per_spill_file(writer_db, tmp_path):
    writer = make_writer(writer_db, tmp_path / "usage.jsonl")
    with pytest.raises(usage_writer.SpillFileHeldError, match="held by another gateway"):
        make_writer(writer_db, tmp_path / "usage.jsonl")
    writer.close(timeout=0)


def test_a_record_the_database_refuses_is_set_aside(writer_db, make_entry, tmp_path, monkeypatch):
    real_insert = usage_writer.insert_usage

    def refuse_poison(session, entries):
        entries = list(entries)
        if any(e.request_id == "req-2" for e in entries):
            raise IntegrityError("INSERT", {}, Exception("check constraint"))
        return real_insert(session, entries)

    monkeypatch.setattr(usage_writer, "insert_usage", refuse_poison)
    spill = tmp_path / "usage.jsonl"
    writer = make_writer(writer_db, spill)
    writer.start()
    for n in range(4):
        writer.submit(make_entry(n))
    assert writer.flush(timeout=10)
    writer.close(timeout=1)
    assert stored_ids(writer_db) == ["req-0", "req-1", "req-3"]
    assert (writer.num_written, writer.num_rejected) == (3, 1)
    rejected = (tmp_path / "usage.jsonl.rejected.jsonl").read_text().splitlines()
    assert [UsageEntry.from_json_dict(json.loads(line)) for line in rejected] == [make_entry(2)]


def test_the_spill_file_is_compacted_under_sustained_backlog(
    writer_db, outage, make_entry, tmp_path, monkeypatch
):
    spill = tmp_path / "usage.jsonl"
    compactions: list[tuple[int, int]] = []
    real_compact = UsageWriter._compact

    def spy(self: UsageWriter) -> None:
        real_compact(self)
        compactions.append((len(spill.read_text().splitlines()), len(self._buffer)))

    monkeypatch.setattr(UsageWriter, "_compact", spy)
    writer = UsageWriter(
        writer_db,
        spill,
        max_batch_size=2,
        initial_backoff_s=0.01,
        max_backoff_s=0.02,
        compact_after_lines=4,
    )
    with outage():
        for n in range(12):
            writer.submit(make_entry(n))
    writer.start()
    assert writer.flush(timeout=20)
    assert writer.close(timeout=1)
    assert stored_ids(writer_db) == [f"req-{n}" for n in range(12)]
    assert compactions
    assert all(lines == pending for lines, pending in compactions)
    assert spill.read_text() == ""
    assert not os.path.exists(str(spill) + ".tmp")


# -- acceptance: durable before the answer completes ------------------------------------------


def refuse_appends(monkeypatch: pytest.MonkeyPatch, code: int = errno.ENOSPC) -> None:
    """The spill file's file system refuses every append (and the probe) with ``code``."""

    def refused(*args: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(SpillFile, "append", refused)
    monkeypatch.setattr(SpillFile, "probe", refused)


async def test_accept_returns_once_an_fsync_covers_the_record_and_fsyncs_are_shared(
    writer_db, make_entry, tmp_path, monkeypatch
):
    spill = tmp_path / "usage.jsonl"
    synced_lines: list[int] = []
    real_sync = SpillFile.sync

    def slow_sync(self: SpillFile) -> None:
        time.sleep(0.05)  # a disk's fsync: the records accepted meanwhile share the next one
        real_sync(self)
        synced_lines.append(spill.read_bytes().count(b"\n"))

    monkeypatch.setattr(SpillFile, "sync", slow_sync)
    writer = UsageWriter(writer_db, spill, linger_s=60)  # the database write waits: file only
    writer.start()
    try:
        accepted = []

        async def accept(n: int) -> None:
            await writer.accept(make_entry(n))
            accepted.append((n, max(synced_lines, default=0)))

        await asyncio.gather(*(accept(n) for n in range(50)))
        assert all(lines >= n + 1 for n, lines in accepted)  # fsynced with it in the file
        assert 1 <= len(synced_lines) <= 10
        assert stored_ids(writer_db) == []
    finally:
        assert writer.close(timeout=10)
    assert sorted(stored_ids(writer_db)) == sorted(f"req-{n}" for n in range(50))


async def test_a_record_the_spill_file_refuses_is_committed_at_once(
    writer_db, make_entry, tmp_path, monkeypatch
):
    spill = tmp_path / "usage.jsonl"
    writer = make_writer(writer_db, spill)
    writer.start()
    try:
        refuse_appends(monkeypatch)
        await writer.accept(make_entry(1))
        assert stored_ids(writer_db) == ["req-1"]
        assert writer.num_written_directly == 1
        assert spill.read_bytes() == b""
        assert not writer.spill_is_writable()
        assert writer.takes_records()  # the database takes them
        monkeypatch.undo()
        assert not writer.spill_is_writable()  # probed again at most every PROBE_INTERVAL_S
        wait_until(writer.spill_is_writable, 3 * PROBE_INTERVAL_S, "the probe to find room")
        await writer.accept(make_entry(2))
        assert writer.flush(timeout=10)
    finally:
        writer.close(timeout=5)
    assert stored_ids(writer_db) == ["req-1", "req-2"]


async def test_a_record_neither_takes_is_not_accepted_and_never_lands_later(
    writer_db, outage, make_entry, tmp_path, monkeypatch
):
    spill = tmp_path / "usage.jsonl"
    writer = make_writer(writer_db, spill)
    writer.start()
    try:
        refuse_appends(monkeypatch, errno.EROFS)
        with outage(), pytest.raises(RecordNotAccepted) as refused:
            await writer.accept(make_entry(1))
        assert not refused.value.is_kept
        assert not writer.takes_records()  # refused before any engine works, for a while
        monkeypatch.undo()
        assert writer.flush(timeout=10)
    finally:
        writer.close(timeout=5)
    assert stored_ids(writer_db) == []
    assert make_writer(writer_db, spill).num_pending == 0  # nothing to replay either


async def test_a_record_whose_fsync_failed_is_kept_and_lands_later(
    writer_db, outage, make_entry, tmp_path, monkeypatch
):
    writer = make_writer(writer_db, tmp_path / "usage.jsonl")
    writer.start()
    try:

        def failed(self: SpillFile) -> None:
            raise OSError(errno.EIO, "injected")

        monkeypatch.setattr(SpillFile, "sync", failed)
        with outage(), pytest.raises(RecordNotAccepted) as refused:
            await writer.accept(make_entry(1))
        assert refused.value.is_kept  # appended: whoever settles money must count it
        monkeypatch.undo()
        assert writer.flush(timeout=10)
    finally:
        writer.close(timeout=5)
    assert stored_ids(writer_db) == ["req-1"]
