"""Deadline polling, for tests and benchmarks that wait for a condition the code under test
offers no event for (another process, a server's state): check, and check again until a
deadline. The one polling helper of the suite: `wait_until` from plain code, `eventually` from
a coroutine (its predicate may be a coroutine function too).

The deadline only bounds a wait that would otherwise hang: set it well above what the
condition needs on a busy machine. A bound on how fast something happens is a benchmark's
job (``bench/``), not a test's. Checks start 10 ms apart and back off to 100 ms, so a slow
condition (a process starting, records landing) costs the machine little while it waits.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

FIRST_POLL_S = 0.01
LAST_POLL_S = 0.1


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, what: str = "") -> None:
    """Return once ``predicate()`` is true; fail the test after ``timeout_s``. A predicate
    that raises ends the wait with its exception (a process it watches has exited, say)."""
    deadline = time.monotonic() + timeout_s
    pause_s = FIRST_POLL_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {what or predicate}")
        time.sleep(pause_s)
        pause_s = min(2 * pause_s, LAST_POLL_S)


async def eventually(
    predicate: Callable[[], object | Awaitable[object]], timeout_s: float = 10.0, what: str = ""
) -> None:
    """`wait_until` for a coroutine: the event loop runs between checks, and a predicate
    that returns an awaitable is awaited."""
    deadline = time.monotonic() + timeout_s
    pause_s = FIRST_POLL_S
    while not await _truth(predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {what or predicate}")
        await asyncio.sleep(pause_s)
        pause_s = min(2 * pause_s, LAST_POLL_S)


async def _truth(value: object | Awaitable[object]) -> bool:
    if inspect.isawaitable(value):
        value = await value
    return bool(value)
