"""A test's listener of ``GET /kv_events``: reads the JSON lines into a queue as they come and
replays the event lines onto the snapshot's hashes, checking the sequence as it goes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx

LINE_TIMEOUT_S = 30.0


class KVEventListener:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client
        self._lines: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()  # None: ended
        self._task: asyncio.Task[None] | None = None
        self.response: httpx.Response | None = None
        self.snapshot: dict[str, Any] = {}
        self.hashes: set[str] = set()
        self.seq = 0
        self.has_ended = False

    async def __aenter__(self) -> KVEventListener:
        request = self._client.build_request("GET", "/kv_events")
        self.response = await self._client.send(request, stream=True)
        self._task = asyncio.get_running_loop().create_task(self._read(self.response))
        if self.response.status_code == 200:
            snapshot = await self.next_line()
            assert snapshot["type"] == "snapshot", snapshot
            self.snapshot = snapshot
            self.hashes = set(snapshot["blocks"])
            self.seq = snapshot["seq"]
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
                    await self._lines.put(json.loads(line))
        except httpx.HTTPError:
            pass
        await self._lines.put(None)

    async def next_line(self, timeout_s: float = LINE_TIMEOUT_S) -> dict[str, Any]:
        """The next line, whatever its type; fails if the stream ends first."""
        line = await asyncio.wait_for(self._lines.get(), timeout_s)
        if line is None:
            self.has_ended = True
            raise AssertionError("the stream ended")
        return line

    async def wait_for_end(self, timeout_s: float = LINE_TIMEOUT_S) -> list[dict[str, Any]]:
        """Every line left until the server ends the stream."""
        lines = []
        while True:
            line = await asyncio.wait_for(self._lines.get(), timeout_s)
            if line is None:
                self.has_ended = True
                return lines
            lines.append(line)

    def apply(self, line: dict[str, Any]) -> None:
        """Replay an event line onto the hashes (load and ping lines change nothing)."""
        if line["type"] in ("load", "ping"):
            return
        assert line["seq"] == self.seq + 1, f"a gap or a repeat: {self.seq} then {line}"
        self.seq = line["seq"]
        if line["type"] == "stored":
            self.hashes.update(line["blocks"])
        elif line["type"] == "evicted":
            self.hashes.difference_update(line["blocks"])
        else:
            assert line["type"] == "cleared", line
            self.hashes.clear()

    async def follow_until(self, predicate: Any, timeout_s: float = LINE_TIMEOUT_S) -> None:
        """Apply lines until ``predicate(self)`` holds (checked before each line)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not predicate(self):
            self.apply(await self.next_line(max(deadline - loop.time(), 0.001)))
