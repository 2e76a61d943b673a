"""asyncio front of the engine, for servers.

The engine loop runs in one background thread (torch and the C kernels release the GIL,
so the event loop stays responsive). Requests and aborts reach it through a command
queue that is drained before every step, so an abort takes effect within one step; each
step's deltas come back to the event loop in one batch.

The engine is built on that same thread, and nothing else in the process should run
tensor work: every thread that opens an OpenMP parallel region gets its own team of
worker threads, and once the process has more OpenMP threads than CPUs, libgomp stops
letting idle workers spin between regions. A decode step opens a few hundred regions, so
each would then wait for futex wake-ups: the model loaded on the main thread and stepped
on this one made a one-sequence decode step ~1.5x slower (4.0 against 6.0 ms for the
large demo model on the 2-core development machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from backend_engine.config import EngineConfig
from backend_engine.core.kv_event_log import KVCacheEvent, KVEventLog
from backend_engine.core.request import Request
from backend_engine.core.step_runner import PlanRunner
from backend_engine.kv_event_fanout import DEFAULT_BUFFER_LINES, KVEventFanout
from backend_engine.llm_engine import LLMEngine, choice_ids
from backend_engine.outputs import EngineStats, RequestOutputDelta
from backend_engine.request_priority import Priority
from backend_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while running a request (not the caller's fault).

    Usually that request's own work failed and the others went on (see
    :mod:`.llm_engine`); only a step that fails with no request to blame fails every
    request in flight.
    """


class EngineStopped(EngineError):
    """The engine shut down before this request finished (e.g. a drain's grace ran out)."""


@dataclass(frozen=True)
class _Add:
    request: Request


@dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]  # the engine's: every choice of the caller's request


class AsyncEngine:
    """Runs the engine loop in a background thread and streams increments to asyncio.

    Usage::

        engine = AsyncEngine(EngineConfig(model=path))   # loads the model
        await engine.start()
        async for delta in engine.generate("req-1", "Hello", SamplingParams()):
            ...
        await engine.abort("req-1")      # or just stop iterating: closing the stream aborts
        await engine.shutdown()
    """

    # The engine thread's latest EngineStats: a frozen object that only that thread makes,
    # and replaces (one reference assignment, atomic) after building, after each step and
    # after each batch of commands, so a reader never sees a step in progress.
    _stats: EngineStats

    def __init__(
        self,
        config: EngineConfig,
        model_name: str | None = None,
        plan_runner: PlanRunner | None = None,
        *,
        kv_event_buffer_lines: int = DEFAULT_BUFFER_LINES,
    ) -> None:
        """Build the engine (load the model), blocking until it is built; `load` awaits it.

        ``plan_runner``: what computes the tokens; by default the model (see `LLMEngine`).
        ``kv_event_buffer_lines``: how far a listener of the prefix-cache events may fall
        behind before it is dropped (`backend_engine.kv_event_fanout`).
        """
        self._spawn(config, model_name, plan_runner, kv_event_buffer_lines)
        self._adopt(self._built.result())  # re-raises what building raised

    @classmethod
    async def load(
        cls,
        config: EngineConfig,
        model_name: str | None = None,
        plan_runner: PlanRunner | None = None,
        *,
        kv_event_buffer_lines: int = DEFAULT_BUFFER_LINES,
    ) -> AsyncEngine:
        """The constructor's engine, built without blocking the event loop (a server answers
        meanwhile). Cancelled, it lets the build finish on its own thread and stops there."""
        self = cls.__new__(cls)
        self._spawn(config, model_name, plan_runner, kv_event_buffer_lines)
        try:
            engine = await asyncio.wrap_future(self._built)
        except asyncio.CancelledError:
            self._stopping.set()
            self._may_run.set()
            raise
        self._adopt(engine)
        return self

    def _spawn(
        self,
        config: EngineConfig,
        model_name: str | None,
        plan_runner: PlanRunner | None,
        kv_event_buffer_lines: int,
    ) -> None:
        self.config = config
        self._model_name = model_name
        self._kv_event_buffer_lines = kv_event_buffer_lines
        self._commands: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue[RequestOutputDelta | BaseException]] = {}
        # The caller's request id -> the engine's ids of its choices (its own for n = 1), and
        # every such id in use (a caller's id must not be another request's choice's).
        self._choice_ids: dict[str, tuple[str, ...]] = {}
        self._engine_ids: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._may_run = threading.Event()  # start() or shutdown() was called
        self._stopping = threading.Event()
        # What the prefix cache reports, appended by the pool on the engine thread and taken
        # out by that thread after each step, for the event loop to publish.
        self._kv_pending: list[KVCacheEvent] = []
        # One thread builds the engine and then runs its loop (see the module docstring); a
        # daemon, so a process that never calls shutdown() can still exit.
        self._built: Future[LLMEngine] = Future()
        self._thread = threading.Thread(
            target=self._thread_main,
            args=(config, plan_runner, self._built),
            name="tollway-engine",
            daemon=True,
        )
        self._thread.start()

    def _adopt(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = self._model_name or Path(self.config.model).resolve().name
        self.max_model_len = engine.max_model_len
        log = KVEventLog(engine.kv_cache.block_size, engine.kv_cache.extra_key)
        self.kv_events = KVEventFanout(log, self._kv_event_buffer_lines)

    async def start(self) -> None:
        if self._stopping.is_set():
            raise RuntimeError("this AsyncEngine has been shut down")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._may_run.set()

    async def shutdown(self) -> None:
        """Stop the loop (requests in flight fail with `EngineStopped`) and the engine's
        thread, and end the prefix-cache event streams; final."""
        if hasattr(self, "kv_events"):
            self.kv_events.close()
        engine = getattr(self, "engine", None)
        if engine is not None and "grammars" in vars(engine):  # a structured output came
            engine.grammars.close()
        self._stopping.set()
        self._wakeup.set()
        self._may_run.set()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join)

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        *,
        tenant_id: str = "default",
        priority: Priority = Priority.INTERACTIVE,
    ) -> AsyncIterator[RequestOutputDelta]:
        """Submit a request; yields deltas until one has ``finished`` set (with ``n`` > 1,
        until each of the ``n`` choices has had one: every delta carries ``request_id`` and
        its choice's ``index``, the choices' deltas interleaved as they come).

        Raises ValueError (before yielding anything) when the prompt is empty,
        prompt + max_tokens exceeds ``max_model_len``, or the structured output's grammar does
        not compile (`InvalidConstraint`, naming the field); the message is fit for a user.
        Raises EngineError, after the deltas already yielded, when the engine fails to
        run this request (any of its choices: the others are aborted). Closing the iterator
        early aborts the request (every choice) and frees its KV blocks.
        """
        if self._loop is None:
            raise RuntimeError("AsyncEngine.start() has not been awaited")
        engine_ids = tuple(choice_ids(request_id, sampling_params.n))
        if request_id in self._streams or not self._engine_ids.isdisjoint(engine_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        grammar = None
        if sampling_params.structured_output is not None:  # off the loop, time-bound
            grammar = await self.engine.grammars.compile_async(sampling_params.structured_output)
        request = self.engine.make_request(
            request_id,
            prompt,
            sampling_params,
            tenant_id=tenant_id,
            priority=priority,
            grammar=grammar,
        )
        stream: asyncio.Queue[RequestOutputDelta | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        self._choice_ids[request_id] = engine_ids
        self._engine_ids.update(engine_ids)
        self._send(_Add(request))
        num_unfinished = len(engine_ids)
        try:
            while num_unfinished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    num_unfinished = 0
                    raise item
                num_unfinished -= item.finished
                if item.error is not None:
                    raise EngineError(f"the engine failed to run this request: {item.error}")
                yield item
        finally:
            self._streams.pop(request_id, None)
            self._choice_ids.pop(request_id, None)
            self._engine_ids.difference_update(engine_ids)
            if num_unfinished:
                self._send(_Abort(engine_ids))

    async def abort(self, request_id: str) -> None:
        """End a request (every choice of it); its stream ends with ``finish_reason`` abort."""
        self._send(_Abort(self._choice_ids.get(request_id, (request_id,))))

    def stats(self) -> EngineStats:
        """The engine's state as of its last step (or command): one consistent snapshot."""
        return self._stats

    def _send(self, command: _Add | _Abort) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _thread_main(
        self, config: EngineConfig, plan_runner: PlanRunner | None, built: Future[LLMEngine]
    ) -> None:
        try:
            engine = LLMEngine(config, plan_runner, kv_events=self._kv_pending)
        except BaseException as exc:
            built.set_exception(exc)
            return
        self._stats = engine.stats()
        built.set_result(engine)
        self._may_run.wait()
        if not self._stopping.is_set():
            self._run()

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            deltas = self._drain_commands()
            if not engine.has_unfinished():
                self._stats = engine.stats()
                self._publish(deltas)
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                deltas.extend(engine.step())
            except Exception as exc:  # no one request to blame: fail those in flight
                logger.exception("engine step failed; aborting the requests in flight")
                failed = list(engine.scheduler.requests)
                callers = {engine.scheduler.requests[rid].group_id for rid in failed}
                engine.abort(failed, reason="error")  # their KV may be unwritten
                self._fail(sorted(callers), EngineError(f"engine step failed: {exc}"))
            self._stats = engine.stats()
            self._publish(deltas)
        engine.abort(list(engine.scheduler.requests))  # they end with EngineStopped instead
        self._stats = engine.stats()
        self._publish([])  # what freeing their blocks changed in the prefix cache
        self._fail(list(self._streams), EngineStopped("the engine is shutting down"))

    def _drain_commands(self) -> list[RequestOutputDelta]:
        deltas: list[RequestOutputDelta] = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return deltas
            if isinstance(command, _Add):
                request_id = command.request.request_id
                if request_id not in self._streams:  # already gone
                    continue
                try:
                    self.engine.add(command.request)
                except Exception as exc:  # it is not queued: fail it alone
                    logger.exception("could not queue request %s", request_id)
                    self._fail([request_id], EngineError(f"could not queue this request: {exc}"))
            else:
                deltas.extend(self.engine.abort(list(command.request_ids)))

    def _publish(self, deltas: list[RequestOutputDelta]) -> None:
        """Hand this step's deltas and prefix-cache events to the event loop, in one call:
        a client that has its answer finds the blocks it stored in the events."""
        if self._loop is None:
            return
        pending = self._kv_pending
        events = pending[:]
        del pending[: len(events)]
        if deltas or events:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
                self._loop.call_soon_threadsafe(self._dispatch, deltas, events)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        if request_ids and self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._dispatch_error, request_ids, error)

    def _dispatch(self, deltas: list[RequestOutputDelta], events: list[KVCacheEvent]) -> None:
        if events:
            self.kv_events.publish(events)
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.put_nowait(delta)

    def _dispatch_error(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(error)
