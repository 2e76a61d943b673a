"""until_client_leaves: the work's result, or None and the work cancelled when the client
goes first; other cancellations and errors pass through."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest
from starlette.types import Message

from openai_protocol.disconnect import run_to_end, until_client_leaves


class Connection:
    def __init__(self) -> None:
        self.leave = asyncio.Event()
        self.is_listening = asyncio.Event()  # someone waits for the disconnect
        self.num_receives = 0

    async def receive(self) -> Message:
        self.num_receives += 1
        if self.num_receives == 1:
            return {"type": "http.request", "body": b"", "more_body": False}  # ignored
        self.is_listening.set()
        await self.leave.wait()
        return {"type": "http.disconnect"}


async def leave_during(
    connection: Connection, work: Coroutine[Any, Any, str]
) -> asyncio.Task[str | None]:
    """Run ``until_client_leaves`` over ``work`` in a task, let the client leave while the
    work waits, and return the finished task."""
    task = asyncio.create_task(until_client_leaves(connection.receive, work))
    await connection.is_listening.wait()  # the work is waiting too: it ran first
    connection.leave.set()
    await asyncio.wait_for(asyncio.shield(task), timeout=5)
    return task


async def test_returns_the_result_when_the_work_ends_first() -> None:
    connection = Connection()

    async def work() -> str:
        await asyncio.sleep(0)
        return "answer"

    this_task = asyncio.current_task()
    assert this_task is not None
    assert await until_client_leaves(connection.receive, work()) == "answer"
    await asyncio.sleep(0)  # the watcher's own cancellation is delivered
    assert asyncio.all_tasks() == {this_task}  # no watcher is left to read the disconnect
    connection.leave.set()  # the disconnect after the response: nothing left to cancel
    await asyncio.sleep(0)  # a cancellation of this task would land here
    assert connection.num_receives == 2
    if hasattr(this_task, "cancelling"):  # Python 3.11+
        assert this_task.cancelling() == 0


async def test_returns_none_and_cancels_the_work_when_the_client_leaves() -> None:
    connection = Connection()
    was_cancelled = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.Event().wait()  # forever
        except asyncio.CancelledError:
            was_cancelled.set()
            raise
        return "never"

    task = await leave_during(connection, work())
    assert task.result() is None
    assert was_cancelled.is_set()
    if hasattr(task, "cancelling"):  # Python 3.11+: the helper undid its own cancel
        assert task.cancelling() == 0


async def test_a_cancellation_from_outside_is_not_taken_for_the_client_leaving() -> None:
    connection = Connection()

    async def handler() -> bool | None:
        return await until_client_leaves(connection.receive, asyncio.Event().wait())

    task = asyncio.create_task(handler())
    await connection.is_listening.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_error_in_the_work_propagates() -> None:
    connection = Connection()

    async def work() -> str:
        raise ValueError("engine refused")

    with pytest.raises(ValueError, match="engine refused"):
        await until_client_leaves(connection.receive, work())


async def test_work_that_turns_the_cancellation_into_an_error_still_reads_as_leaving() -> None:
    connection = Connection()

    async def work() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ConnectionResetError("the library's own error") from None
        return "never"

    assert (await leave_during(connection, work())).result() is None


async def test_run_to_end_finishes_a_clean_up_through_cancellations_then_raises() -> None:
    steps: list[int] = []
    is_waiting = [asyncio.Event() for _ in range(3)]
    may_go_on = [asyncio.Event() for _ in range(3)]

    async def clean_up() -> None:
        for i in range(3):
            is_waiting[i].set()
            await may_go_on[i].wait()
            steps.append(i)

    task = asyncio.create_task(run_to_end(clean_up()))
    for i in range(2):  # two cancellations land while it runs, at steps 0 and 1
        await is_waiting[i].wait()
        task.cancel()
        may_go_on[i].set()
    may_go_on[2].set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == [0, 1, 2]
    assert await asyncio.create_task(run_to_end(clean_up())) is None  # uncancelled: no raise
