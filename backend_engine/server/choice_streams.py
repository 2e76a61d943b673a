"""The engine requests behind one API request, as one stream of labelled choices.

A completion's list of prompts is one engine request per prompt, each generating the
request's ``n`` choices (one engine request: the prompt is prefilled once and its deltas
carry their choice's ``index``). Their deltas are merged as they come, each labelled with
its choice in the answer, ``prompt_index * n + delta.index``::

    streams = await ChoiceStreams.start(engine, request_ids, prompts, meta)
    try:                                  # every prompt submitted; a refusal closed the rest
        async for choice in streams: ...
    finally:
        await streams.close()             # aborts every request not finished; idempotent

A single prompt (a chat, most completions) is iterated directly; several are each read by
a task of their own into one queue, so no prompt waits for another's tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from starlette.types import Receive

from backend_engine.async_engine import AsyncEngine
from backend_engine.outputs import RequestOutputDelta
from backend_engine.server.engine_prompts import EnginePrompt
from backend_engine.server.generation import GenerationStream
from backend_engine.server.request_reader import RequestMeta
from openai_protocol.disconnect import run_to_end, until_client_leaves


@dataclass(frozen=True)
class ChoiceDelta:
    """An engine delta labelled with the answer's choice it belongs to."""

    prompt_index: int
    index: int  # the choice's ``index`` in the answer
    delta: RequestOutputDelta


_END = object()  # a reader's last item: its stream has ended
_QueueItem = tuple[int, RequestOutputDelta] | BaseException | object


def request_ids(response_id: str, num_prompts: int) -> list[str]:
    """The engine request id of each prompt: the response's id, suffixed when several."""
    if num_prompts == 1:
        return [response_id]
    return [f"{response_id}-{n}" for n in range(num_prompts)]


class ChoiceStreams:
    def __init__(self, streams: list[GenerationStream], num_choices_per_prompt: int) -> None:
        self._streams = streams
        self._n = num_choices_per_prompt
        self._readers: list[asyncio.Task[None]] = []
        self._is_closed = False

    @classmethod
    async def start(
        cls,
        engine: AsyncEngine,
        ids: Sequence[str],
        prompts: Sequence[EnginePrompt],
        meta: RequestMeta,
        on_first_token: Callable[[], None] | None = None,
    ) -> ChoiceStreams:
        """Submit every prompt (request ``ids[i]`` for ``prompts[i]``) and wait for each
        one's first delta, so refusals surface as 400s; if any is refused or this is
        cancelled, the others are aborted."""
        once = _Once(on_first_token)
        starts = [
            GenerationStream.start(engine, request_id, p.token_ids, p.params, meta, once)
            for request_id, p in zip(ids, prompts, strict=True)
        ]
        n = prompts[0].params.n
        if len(starts) == 1:
            return cls([await starts[0]], n)
        tasks = [asyncio.ensure_future(start) for start in starts]
        try:
            await asyncio.wait(tasks)
        except BaseException:
            await run_to_end(_close_started(tasks))
            raise
        for task in tasks:
            refusal = task.exception()
            if refusal is not None:  # the first prompt's, in order
                await run_to_end(_close_started(tasks))
                raise refusal
        return cls([t.result() for t in tasks], n)

    @property
    def is_finished(self) -> bool:
        return all(stream.is_finished for stream in self._streams)

    def _label(self, prompt_index: int, delta: RequestOutputDelta) -> ChoiceDelta:
        return ChoiceDelta(prompt_index, prompt_index * self._n + delta.index, delta)

    async def __aiter__(self) -> AsyncGenerator[ChoiceDelta, None]:
        if len(self._streams) == 1:
            async for delta in self._streams[0]:
                yield self._label(0, delta)
            return
        queue: asyncio.Queue[_QueueItem] = asyncio.Queue()
        self._readers = [
            asyncio.ensure_future(_read(n, stream, queue)) for n, stream in enumerate(self._streams)
        ]
        try:
            num_open = len(self._readers)
            while num_open:
                item = await queue.get()
                if item is _END:
                    num_open -= 1
                elif isinstance(item, BaseException):
                    raise item
                elif isinstance(item, tuple):
                    yield self._label(*item)
        finally:
            await self._stop_readers()

    async def _stop_readers(self) -> None:
        readers, self._readers = self._readers, []
        for reader in readers:
            reader.cancel()
        if readers:
            await asyncio.wait(readers)

    async def close(self) -> None:
        """Stop reading and abort every request that has not finished; idempotent."""
        if self._is_closed:
            return
        self._is_closed = True

        async def close_all() -> None:
            await self._stop_readers()
            for stream in self._streams:
                await stream.close()

        await run_to_end(close_all())

    async def collect(self, receive: Receive) -> list[ChoiceDelta] | None:
        """Every choice's deltas until all have finished, or None if the client leaves
        first (the ASGI ``http.disconnect`` is watched meanwhile, so an abandoned request
        stops generating)."""
        choices: list[ChoiceDelta] = []

        async def gather() -> list[ChoiceDelta]:
            async with aclosing(self.__aiter__()) as merged:
                async for choice in merged:
                    choices.append(choice)
            return choices

        try:
            return await until_client_leaves(receive, gather())
        finally:
            await self.close()


async def _read(
    prompt_index: int, stream: GenerationStream, queue: asyncio.Queue[_QueueItem]
) -> None:
    """Move one prompt's deltas into the shared queue, then its end (or its error)."""
    try:
        async with aclosing(stream.__aiter__()) as deltas:
            async for delta in deltas:
                queue.put_nowait((prompt_index, delta))
    except Exception as exc:
        queue.put_nowait(exc)
    finally:
        queue.put_nowait(_END)


async def _close_started(tasks: list[asyncio.Task[GenerationStream]]) -> None:
    """Cancel the starts still under way and close the streams of those that succeeded."""
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled() and task.exception() is None:
            await task.result().close()


class _Once:
    """A callback that runs on its first call only (the first token of any prompt)."""

    def __init__(self, callback: Callable[[], None] | None) -> None:
        self._callback = callback

    def __call__(self) -> None:
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()
