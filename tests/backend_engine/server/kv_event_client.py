"""A test's listener of ``GET /kv_events``: reads the lines into a queue as they come, decoded
with `engine_protocol.kv_events.decode` (the bytes as they came stay in ``raw_lines``), and
replays the change lines onto the snapshot's hashes, checking the sequence as it goes."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx

from engine_protocol.block_hash import BlockHash
from engine_protocol.kv_events import (
    ClearedLine,
    EvictedLine,
    KvEventLine,
    LoadLine,
    PingLine,
    SnapshotLine,
    StoredLine,
    decode,
)

LINE_TIMEOUT_S = 30.0


class KVEventListener:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client
        self._lines: asyncio.Queue[KvEventLine | None] = asyncio.Queue()  # None: ended
        self._task: asyncio.Task[None] | None = None
        self.response: httpx.Response | None = None
        self.raw_lines: list[str] = []
        self.snapshot: SnapshotLine | None = None
        self.hashes: set[BlockHash] = set()
        self.seq = 0
        self.has_ended = False

    async def __aenter__(self) -> KVEventListener:
        request = self._client.build_request("GET", "/kv_events")
        self.response = await self._client.send(request, stream=True)
        self._task = asyncio.get_running_loop().create_task(self._read(self.response))
        if self.response.status_code == 200:
            snapshot = await self.next_line()
            assert isinstance(snapshot, SnapshotLine), snapshot
            self.snapshot = snapshot
            self.hashes = set(snapshot.blocks)
            self.seq = snapshot.seq
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.response is not None:
            await self.response.aclose()

    async def _read(self, response: httpx.Response) -> None:
        try:
            async for line in response.aiter_lines():
                if line:
                    self.raw_lines.append(line)
                    await self._lines.put(decode(line))
        except httpx.HTTPError:
            pass
        await self._lines.put(None)

    async def next_line(self, timeout_s: float = LINE_TIMEOUT_S) -> KvEventLine:
        """The next line, whatever its type; fails if the stream ends first."""
        line = await asyncio.wait_for(self._lines.get(), timeout_s)
        if line is None:
            self.has_ended = True
            raise AssertionError("the stream ended")
        return line

    async def next_change(self, timeout_s: float = LINE_TIMEOUT_S) -> KvEventLine:
        """The next line that is neither load nor ping."""
        line = await self.next_line(timeout_s)
        while isinstance(line, LoadLine | PingLine):
            line = await self.next_line(timeout_s)
        return line

    async def wait_for_end(self, timeout_s: float = LINE_TIMEOUT_S) -> list[KvEventLine]:
        """Every line left until the server ends the stream."""
        lines = []
        while True:
            line = await asyncio.wait_for(self._lines.get(), timeout_s)
            if line is None:
                self.has_ended = True
                return lines
            lines.append(line)

    def apply(self, line: KvEventLine) -> None:
        """Replay a change line onto the hashes (load and ping lines change nothing)."""
        if isinstance(line, LoadLine | PingLine):
            return
        assert isinstance(line, StoredLine | EvictedLine | ClearedLine), line
        assert line.seq == self.seq + 1, f"a gap or a repeat: {self.seq} then {line}"
        self.seq = line.seq
        if isinstance(line, StoredLine):
            self.hashes.update(line.blocks)
        elif isinstance(line, EvictedLine):
            self.hashes.difference_update(line.blocks)
        else:
            self.hashes.clear()

    async def follow_until(self, predicate: Any, timeout_s: float = LINE_TIMEOUT_S) -> None:
        """Apply lines until ``predicate(self)`` holds (checked before each line)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not predicate(self):
            self.apply(await self.next_line(max(deadline - loop.time(), 0.001)))
