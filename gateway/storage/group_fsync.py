"""Group commit for the spill file: every caller waiting for an fsync shares the next one.

A request's answer may not complete before its usage record is fsynced
(`gateway.storage.usage_writer`). One fsync per request would cost each a disk flush and
queue them behind each other; here a thread runs one fsync for everyone who asked since the
last began, so under load a flush covers many records and a request waits at most about
two flushes::

    request  append ─► synced() ─┐ waits          syncer thread: waiters taken ─► fsync
    request  append ─► synced() ─┤                  (every one appended before it asked)
                                 └◄── one call_soon_threadsafe per event loop ◄─┘

The thread resolves asyncio futures through ``call_soon_threadsafe``, one call per event loop
per fsync, not one per record, so a burst costs the loop one wake-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

import anyio


class GroupFsync:
    def __init__(self, sync: Callable[[], None], on_failure: Callable[[OSError], None]) -> None:
        """``sync``: the fsync (raises ``OSError``); ``on_failure``: told of each failure."""
        self._sync = sync
        self._on_failure = on_failure
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]] = []
        self._is_closing = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="usage-spill-fsync", daemon=True)
        self._thread.start()

    def close(self, timeout: float) -> None:
        """Answer whoever still waits, then stop the thread."""
        with self._cond:
            self._is_closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    async def synced(self) -> bool:
        """Wait for an fsync that began after this call (so it covers every append made
        before it); ``False`` if that fsync failed."""
        if self._thread is None:  # not started (tools, tests): fsync here
            try:
                await anyio.to_thread.run_sync(self._sync)
            except OSError as exc:
                self._on_failure(exc)
                return False
            return True
        loop = asyncio.get_running_loop()
        synced = loop.create_future()
        with self._cond:
            self._waiters.append((loop, synced))
            self._cond.notify()
        return bool(await synced)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._waiters) or self._is_closing)
                if not self._waiters:
                    return
                waiters, self._waiters = self._waiters, []
            try:
                self._sync()
                is_synced = True
            except OSError as exc:
                self._on_failure(exc)
                is_synced = False
            by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[bool]]] = {}
            for loop, synced in waiters:
                by_loop.setdefault(loop, []).append(synced)
            for loop, futures in by_loop.items():
                with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits
                    loop.call_soon_threadsafe(_resolve, futures, is_synced)


def _resolve(futures: list[asyncio.Future[bool]], value: bool) -> None:
    for future in futures:
        if not future.done():  # its request may have been cancelled meanwhile
            future.set_result(value)
