"""Work that stops when the HTTP client leaves, and clean-up that does not: the engine
server's and the gateway's.

A request whose client has gone should stop generating at once (the engine frees its KV
blocks; the gateway closes its upstream call, which aborts the engine's request). ASGI
reports the departure as an ``http.disconnect`` message from ``receive``, which nobody
reads while the handler waits on its work, so one small task reads it and cancels the
handler's task.

Plain asyncio, not an anyio task group: the work runs in the request's own task, and the
watcher is the only task added. A task group, its cancel scopes and the async-library
lookups they make cost ~10% of a streamed request's CPU in the gateway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


async def until_client_leaves(receive: Receive, work: Awaitable[T]) -> T | None:
    """``await work``, unless the client disconnects first: then ``work`` is cancelled
    where it waits and ``None`` is returned. The rest of the body must have been read
    (the next message is then the disconnect). Any other cancellation goes on as usual.

    A server reports a disconnect once the response is complete, too (uvicorn does); that
    one arrives after ``work`` has returned and changes nothing.
    """
    this_task = asyncio.current_task()
    if this_task is None:
        raise RuntimeError("until_client_leaves runs in an asyncio task")
    is_done = client_left = False

    async def watch_for_disconnect() -> None:
        nonlocal client_left
        while (await receive())["type"] != "http.disconnect":
            pass
        if not is_done:
            client_left = True
            this_task.cancel()

    watcher = asyncio.ensure_future(watch_for_disconnect())
    result: T | None = None
    try:
        result = await work
    except (asyncio.CancelledError, Exception):
        # Once the client has left, however the cancelled work ended (some libraries turn a
        # cancellation into an error of their own), the caller only learns that it left.
        if not client_left:
            raise
    finally:
        is_done = True
        watcher.cancel()
    if not client_left:
        return result
    uncancel = getattr(this_task, "uncancel", None)  # Python 3.11+: undo our own cancel
    if uncancel is not None:
        uncancel()
    return None


async def run_to_end(work: Awaitable[None]) -> None:
    """Await ``work`` (a clean-up) to its end even if this task is cancelled meanwhile; a
    cancellation that arrived is raised afterwards. anyio's ``CancelScope(shield=True)``
    does not do this: it shields from anyio's cancel scopes, not from ``Task.cancel``,
    which is how requests are cancelled here."""
    task = asyncio.ensure_future(work)
    was_cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done() and task.cancelled():
                raise
            was_cancelled = True
    if was_cancelled:
        raise asyncio.CancelledError
    task.result()
