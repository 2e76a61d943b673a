"""asyncio front of the engine, for servers. (Interface fixed; body being written.)"""

from __future__ import annotations

from collections.abc import AsyncIterator

from backend_engine.config import EngineConfig
from backend_engine.outputs import EngineStats, RequestOutputDelta
from backend_engine.request_priority import Priority
from backend_engine.sampling_params import SamplingParams


class AsyncEngine:
    """Runs the engine loop in a background thread and streams increments to asyncio.

    Usage::

        engine = AsyncEngine(EngineConfig(model=path))   # loads the model
        await engine.start()
        async for delta in engine.generate("req-1", "Hello", SamplingParams()):
            ...
        await engine.abort("req-1")      # or just stop iterating: closing the stream aborts
        await engine.shutdown()

    Attributes: ``tokenizer`` (backend_engine.tokenizer.Tokenizer), ``model_name``
    (the served model id: the checkpoint directory's name unless given),
    ``max_model_len`` (int).
    """

    def __init__(self, config: EngineConfig, model_name: str | None = None) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        raise NotImplementedError

    async def shutdown(self) -> None:
        raise NotImplementedError

    def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        *,
        tenant_id: str = "default",
        priority: Priority = Priority.INTERACTIVE,
    ) -> AsyncIterator[RequestOutputDelta]:
        """Submit a request; yields deltas until one has ``finished`` set.

        Raises ValueError (before yielding anything) when the prompt is empty or
        prompt + max_tokens exceeds ``max_model_len``; the message is fit for a user.
        Closing the iterator early aborts the request and frees its KV blocks.
        """
        raise NotImplementedError

    async def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError
