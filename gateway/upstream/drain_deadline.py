"""The drain's deadline: the moment a stopping gateway ends what still waits on an engine.

``tollway serve`` drains on SIGTERM (`gateway.launcher.draining_server`): after
``drain_delay_s`` its listener closes and the requests in flight get ``drain_grace_s`` to
finish. At the end of that grace the server reaches this deadline, and every wait on an
engine that a request makes through `DrainDeadline.wait` ends at once with `DrainCutOff`,
which the request path answers while it still can, billed for what the engine produced:

- a non-streamed request still waiting for its answer: its engine is asked to stop it (the
  answer then comes at once, with its usage) and the client gets a 503
  ``server_shutting_down`` with ``Retry-After`` (`gateway.api.completions`);
- a stream: an error event and ``[DONE]``, billed for what was relayed
  (`gateway.upstream.stream_relay`).

uvicorn's own graceful-shutdown timeout, a margin later, is only a backstop: what it cancels
gets a plain-text 500 and a record of no tokens.

A wait is ended by cancelling the waiting task where it waits, a cancellation this module
then turns into `DrainCutOff`, as ``asyncio.timeout`` turns its own into ``TimeoutError``. No
task is added per wait: a stream waits once per batch of events, and racing each read with a
second task would cost every batch. A task that is not waiting here when the deadline comes
(it is sending to a slow client) is not interrupted; its next wait ends at once. One wait per
task at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

CUT_OFF_MESSAGE = "the drain's deadline came"


class DrainCutOff(Exception):
    """The drain's deadline came while this request waited on its engine."""


class DrainDeadline:
    """One per gateway app: reached once, by the server, at the end of the drain's grace."""

    def __init__(self) -> None:
        self._is_reached = False
        self._waiting: dict[asyncio.Task[Any], bool] = {}  # waiting task: whether cut off

    @property
    def is_reached(self) -> bool:
        return self._is_reached

    def reach(self) -> None:
        """End every wait now, and every later one at once. Call it on the event loop."""
        if self._is_reached:
            return
        self._is_reached = True
        for task in self._waiting:
            self._waiting[task] = True
            task.cancel(msg=CUT_OFF_MESSAGE)

    async def wait(self, work: Awaitable[T]) -> T:
        """``await work`` unless the deadline comes first: then ``work`` is cancelled where it
        waits (a coroutine not started yet is closed) and `DrainCutOff` raised. A task also
        cancelled for another reason meanwhile (Python 3.11+ can tell) stays cancelled."""
        if self._is_reached:
            _close(work)
            raise DrainCutOff
        task = asyncio.current_task()
        if task is None or task in self._waiting:
            _close(work)
            raise RuntimeError("DrainDeadline.wait runs in an asyncio task, one wait at a time")
        self._waiting[task] = False
        try:
            result = await work
        except (asyncio.CancelledError, Exception):
            # Some libraries turn a cancellation into an error of their own: once cut off,
            # however the work ended, the caller only learns that.
            if not self._waiting[task] or _uncancel(task) > 0:
                raise
            raise DrainCutOff from None
        finally:
            is_cut_off = self._waiting.pop(task)
        if is_cut_off:  # the work finished anyway, swallowing the cancellation
            _uncancel(task)
        return result


def _uncancel(task: asyncio.Task[Any]) -> int:
    """Undo one cancellation of ``task``; the cancellations still pending (Python 3.11+: 0
    before it, where there is no count)."""
    uncancel = getattr(task, "uncancel", None)
    return int(uncancel()) if uncancel is not None else 0


def _close(work: Awaitable[Any]) -> None:
    close = getattr(work, "close", None)  # a coroutine or an async generator's step
    if close is not None and not isinstance(work, asyncio.Future):
        close()
