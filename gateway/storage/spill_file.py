"""The usage writer's spill file: JSON lines appended whole or not at all, locked, fsynced.

A raw file descriptor opened with ``O_APPEND``, not a buffered file object: a buffered
append that fails (the disk full, the file at its size limit, the file system read-only)
leaves its bytes in the buffer, and the next flush would write them after all, a record
refused now accepted later. Here an append either lands whole or is cut off again
(``ftruncate`` back to the size before it) and raises, so a torn line never sits ahead of
the next record and a refused record never comes back.

`probe` asks whether an append would succeed now without appending a record: it writes a
block of newlines (which replay skips) and cuts them off again. It is how a writer that was
refused finds out that the disk has room again while no request tries.

One writer per file: an exclusive ``flock`` is taken on open and held until `close`;
a second opener gets :class:`SpillFileHeldError`. ``flock`` belongs to the open file, so
`replace` (compaction) locks the new file before it lets the old one go.

Thread safety: appends, `truncate`, `replace` and `close` are called under the usage
writer's lock; `sync` is not (an fsync must never hold up an append). It takes this file's
own lock, which `replace` and `close` take too, so an fsync never runs on a descriptor that
was closed (or reused) under it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

PROBE_BYTES = 4096  # about four records: room for one probe is room for the next record


class SpillFileHeldError(RuntimeError):
    """Another writer (another gateway on the same data directory) holds the spill file:
    two writers would replay and truncate each other's records."""

    def __init__(self, spill_path: Path) -> None:
        super().__init__(
            f"{spill_path} is held by another gateway (its usage spill file is locked): "
            "stop that gateway first, or give this one another data directory"
        )
        self.spill_path = spill_path


class SpillFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd_lock = threading.Lock()
        self._fd = _open_locked(path)
        self._size = os.fstat(self._fd).st_size
        self._is_torn = False

    @property
    def is_closed(self) -> bool:
        return self._fd < 0

    def lines(self) -> Iterator[bytes]:
        """The complete lines in the file, blank ones skipped. A torn last line (a crash in
        the middle of an append) is cut off: it was never acknowledged."""
        with open(self._fd, "rb", closefd=False) as reader:
            reader.seek(0)
            data = reader.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            os.ftruncate(self._fd, end)
            self._size = end
        for line in data[:end].splitlines():
            if line.strip():
                yield line

    def append(self, data: bytes) -> None:
        """Append ``data`` whole, or raise ``OSError`` leaving the file as it was."""
        start = self._size
        if self._is_torn:  # a failed append's bytes could not be cut off: end that line
            data = b"\n" + data
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:
            self._is_torn = not _cut_back(self._fd, start)
            raise
        self._size = start + len(data)
        self._is_torn = False

    def probe(self) -> None:
        """Raise ``OSError`` unless ``PROBE_BYTES`` could be appended now (nothing stays)."""
        start = self._size
        try:
            if os.write(self._fd, b"\n" * PROBE_BYTES) < PROBE_BYTES:
                raise OSError(errno.ENOSPC, "the spill file took part of the probe")
        finally:
            if not _cut_back(self._fd, start):
                self._is_torn = True

    def sync(self) -> None:
        """fsync what was appended so far (``OSError`` if the file system cannot)."""
        with self._fd_lock:
            if self._fd >= 0:
                os.fsync(self._fd)

    def truncate(self) -> None:
        os.ftruncate(self._fd, 0)
        self._size = 0

    def replace(self, lines: Iterable[bytes]) -> None:
        """Swap the file for one holding only ``lines`` (written and fsynced aside first, so
        a crash leaves either file whole). ``OSError`` leaves the old file in place."""
        tmp_path = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp_path, "wb") as tmp:
                for line in lines:
                    tmp.write(line + b"\n")
                tmp.flush()
                os.fsync(tmp.fileno())
        except OSError:
            tmp_path.unlink(missing_ok=True)
            raise
        os.replace(tmp_path, self.path)
        new_fd = _open_locked(self.path)
        with self._fd_lock:
            os.close(self._fd)
            self._fd = new_fd
            self._size = os.fstat(new_fd).st_size

    def close(self) -> None:
        """fsync (best effort) and close; releases the lock."""
        with self._fd_lock:
            if self._fd < 0:
                return
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1


def _open_locked(path: Path) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise SpillFileHeldError(path) from exc
    return fd


def _cut_back(fd: int, size: int) -> bool:
    """Drop whatever part of a failed append landed; ``False`` if that failed too (the file
    system refusing everything): the next append then starts on a new line, and replay
    skips the torn one."""
    try:
        os.ftruncate(fd, size)
    except OSError:
        return False
    return True
