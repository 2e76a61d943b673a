"""One engine request as a handler sees it: started, iterated, and always cleaned up.

A request with ``n`` choices is one engine request: its deltas carry their choice's
``index``, and it is finished once every choice has finished (or the engine's stream ends).

Whatever ends a request early (the client going away, a cancelled task, an error
while sending), :meth:`GenerationStream.close` closes the engine's stream and
aborts the request, so its KV blocks are freed within one engine step::

    stream = await GenerationStream.start(...)     # ValueError from the engine -> 400
    try:
        async for delta in stream: ...
    finally:
        await stream.close()                       # shielded; no-op once finished
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from backend_engine.async_engine import AsyncEngine
from backend_engine.outputs import RequestOutputDelta
from backend_engine.sampling_params import SamplingParams
from backend_engine.server.errors import invalid_request
from backend_engine.server.request_reader import RequestMeta
from backend_engine.server.sampling import param_named_by
from backend_engine.structured_output.constraint import InvalidConstraint
from openai_protocol.disconnect import run_to_end


class GenerationStream:
    def __init__(
        self,
        engine: AsyncEngine,
        request_id: str,
        deltas: AsyncIterator[RequestOutputDelta],
        first: RequestOutputDelta,
        on_first_token: Callable[[], None] | None,
        num_choices: int = 1,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self._deltas = deltas
        self._first: RequestOutputDelta | None = first
        self._on_first_token = on_first_token
        self.num_choices = num_choices
        self._finished_choices: set[int] = set()
        self.is_finished = False
        self._is_closed = False

    @classmethod
    async def start(
        cls,
        engine: AsyncEngine,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        meta: RequestMeta,
        on_first_token: Callable[[], None] | None = None,
    ) -> GenerationStream:
        """Submit the request and wait for its first delta, so refusals surface as 400s."""
        deltas: AsyncIterator[RequestOutputDelta] | None = None
        try:
            deltas = engine.generate(
                request_id,
                prompt_token_ids,
                params,
                tenant_id=meta.tenant_id,
                priority=meta.priority,
            )
            first = await deltas.__anext__()
        except InvalidConstraint as exc:
            raise invalid_request(exc.message, param=exc.param) from None
        except ValueError as exc:
            raise invalid_request(str(exc), param=param_named_by(str(exc))) from None
        except BaseException:
            await run_to_end(_abandon(engine, request_id, deltas))
            raise
        return cls(engine, request_id, deltas, first, on_first_token, params.n)

    async def __aiter__(self) -> AsyncGenerator[RequestOutputDelta, None]:
        first, self._first = self._first, None
        if first is not None:
            self._note(first)
            yield first
        while not self.is_finished:
            try:
                delta = await self._deltas.__anext__()
            except StopAsyncIteration:
                self.is_finished = True
                return
            self._note(delta)
            yield delta

    def _note(self, delta: RequestOutputDelta) -> None:
        if delta.new_token_ids and self._on_first_token is not None:
            self._on_first_token()
            self._on_first_token = None
        if delta.finished:
            self._finished_choices.add(delta.index)
            self.is_finished = len(self._finished_choices) >= self.num_choices

    async def close(self) -> None:
        """Close the engine's stream and abort the request unless it finished; idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        await run_to_end(_abandon(self.engine, self.request_id, self._deltas, self.is_finished))


async def _abandon(
    engine: AsyncEngine,
    request_id: str,
    deltas: AsyncIterator[RequestOutputDelta] | None,
    is_finished: bool = False,
) -> None:
    """Close the engine's stream and abort the request unless it finished."""
    if deltas is not None:
        await _aclose(deltas)
    if not is_finished:
        await engine.abort(request_id)


async def _aclose(iterator: AsyncIterator[RequestOutputDelta]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
