"""`DrainDeadline`: a wait on an engine ends with `DrainCutOff` when the drain's deadline comes,
the task it ran in goes on (not cancelled), and later waits end at once."""

from __future__ import annotations

import asyncio
import inspect
import sys

import pytest

from gateway.upstream.drain_deadline import DrainCutOff, DrainDeadline


async def test_a_wait_returns_the_work_s_result_before_the_deadline() -> None:
    deadline = DrainDeadline()

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert await deadline.wait(answer()) == 42
    assert not deadline.is_reached


async def test_the_deadline_cuts_a_wait_off_and_the_task_goes_on() -> None:
    deadline = DrainDeadline()
    engine_answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def request() -> str:
        try:
            await deadline.wait(engine_answer)
        except DrainCutOff:
            await asyncio.sleep(0.01)  # the request answers: the task is not cancelled
            return "503"
        return "200"

    task = asyncio.ensure_future(request())
    await asyncio.sleep(0.01)
    deadline.reach()
    assert await task == "503"
    assert engine_answer.cancelled()  # the wait was ended where it waited
    if sys.version_info >= (3, 11):
        assert task.cancelling() == 0


async def test_a_wait_after_the_deadline_ends_at_once_and_closes_its_work() -> None:
    deadline = DrainDeadline()
    deadline.reach()

    async def never() -> None:
        await asyncio.Event().wait()

    work = never()
    with pytest.raises(DrainCutOff):
        await deadline.wait(work)
    assert inspect.getcoroutinestate(work) == inspect.CORO_CLOSED  # not left un-awaited


async def test_a_task_busy_elsewhere_is_not_interrupted_and_its_next_wait_ends() -> None:
    deadline = DrainDeadline()
    sending = asyncio.Event()
    steps: list[str] = []

    async def stream() -> None:
        steps.append(await deadline.wait(asyncio.sleep(0, "batch")))
        await sending.wait()  # sending to the client: no wait on the engine
        steps.append("sent")
        try:
            await deadline.wait(asyncio.sleep(10))
        except DrainCutOff:
            steps.append("cut off")

    task = asyncio.ensure_future(stream())
    await asyncio.sleep(0.01)
    deadline.reach()
    sending.set()
    await asyncio.wait_for(task, 5)
    assert steps == ["batch", "sent", "cut off"]


async def test_work_that_turns_the_cancellation_into_its_own_error_is_still_cut_off() -> None:
    deadline = DrainDeadline()

    async def library_call() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise OSError("connection closed") from None

    task = asyncio.ensure_future(deadline.wait(library_call()))
    await asyncio.sleep(0.01)
    deadline.reach()
    with pytest.raises(DrainCutOff):
        await task


async def test_an_error_before_the_deadline_is_the_work_s_own() -> None:
    deadline = DrainDeadline()

    async def failing() -> None:
        raise OSError("engine went away")

    with pytest.raises(OSError, match="engine went away"):
        await deadline.wait(failing())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 counts no cancellations")
async def test_a_task_also_cancelled_for_another_reason_stays_cancelled() -> None:
    deadline = DrainDeadline()
    task = asyncio.ensure_future(deadline.wait(asyncio.sleep(10)))
    await asyncio.sleep(0.01)
    task.cancel()  # e.g. the client left
    deadline.reach()
    with pytest.raises(asyncio.CancelledError):
        await task
