"""Deadline polling, for tests that wait for a condition the code under test offers no
event for (another process, a server's state): check, and check again until a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.01


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, what: str = "") -> None:
    """Return once ``predicate()`` is true; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {what or predicate}")
        time.sleep(POLL_S)


async def eventually(
    predicate: Callable[[], object], timeout_s: float = 10.0, what: str = ""
) -> None:
    """`wait_until` for a coroutine: the event loop runs between checks."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {what or predicate}")
        await asyncio.sleep(POLL_S)
