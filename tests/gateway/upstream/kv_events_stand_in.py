"""A stand-in for an engine's ``GET /kv_events`` (contracts: the prefix-cache event stream),
served by uvicorn on a Unix socket in a thread, driven by the test from its own thread.

Each connection gets the snapshot (every block held, the current ``seq``), then one load
line, then every change published while it is connected. ``restart`` plays a new engine
process (a new ``engine_id``, an empty cache, seq 0, every stream dropped). ``status`` other
than 200 answers with that status and no stream (a foreign server: 404). Anything else the
app is asked (``POST /v1/...``) is answered by ``fallback``, if given.
"""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterable
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from tests.support.uvicorn_thread import start_in_thread, stop_thread

_CLOSE = b""


class StandInKvEvents:
    def __init__(self, block_size: int, extra_key: bytes, fallback: ASGIApp | None = None) -> None:
        self.block_size = block_size
        self.extra_key = extra_key
        self.engine_id = uuid.uuid4().hex
        self.seq = 0
        self.blocks: set[bytes] = set()
        self.load: dict[str, int] = {
            "num_waiting": 0,
            "num_running": 0,
            "kv_blocks_used": 0,
            "kv_blocks_total": 64,
        }
        self.status = 200
        self.media_type = b"application/x-ndjson"  # of the stream's 200 answer
        self.num_connections = 0
        self._fallback = fallback
        self._lock = threading.Lock()
        self._streams: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[bytes]]] = []
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.socket_path = f"{tempfile.mkdtemp(prefix='tw-kv-')}/engine.sock"

    @property
    def upstream(self) -> str:
        return f"unix:{self.socket_path}"

    @property
    def num_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def start(self) -> StandInKvEvents:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.socket_path)
        config = uvicorn.Config(
            self, loop="asyncio", http="h11", lifespan="off", log_level="warning"
        )
        self._server = uvicorn.Server(config)
        self._thread = start_in_thread(self._server, [sock])
        return self

    def stop(self) -> None:
        self.drop_streams()
        if self._server is not None and self._thread is not None:
            stop_thread(self._server, self._thread)

    # --- what the engine's cache does -------------------------------------------------------

    def store(self, blocks: Iterable[bytes]) -> None:
        blocks = list(blocks)
        with self._lock:
            self.blocks.update(blocks)
            self._publish_change({"type": "stored", "blocks": [b.hex() for b in blocks]})

    def evict(self, blocks: Iterable[bytes]) -> None:
        blocks = list(blocks)
        with self._lock:
            self.blocks.difference_update(blocks)
            self._publish_change({"type": "evicted", "blocks": [b.hex() for b in blocks]})

    def clear(self) -> None:
        with self._lock:
            self.blocks.clear()
            self._publish_change({"type": "cleared"})

    def set_load(self, **load: int) -> None:
        with self._lock:
            self.load.update(load)
            self._publish({"type": "load", **self.load})

    def send_raw(self, line: bytes) -> None:
        """A line as it is, e.g. one with a seq gap, for the client to notice."""
        with self._lock:
            for loop, queue in self._streams:
                loop.call_soon_threadsafe(queue.put_nowait, line)

    def drop_streams(self) -> None:
        """Close every stream (the engine disconnects its subscribers)."""
        self.send_raw(_CLOSE)

    def restart(self) -> None:
        self.drop_streams()
        with self._lock:
            self.engine_id = uuid.uuid4().hex
            self.seq = 0
            self.blocks = set()

    def _publish_change(self, event: dict[str, Any]) -> None:
        self.seq += 1
        self._publish({**event, "seq": self.seq})

    def _publish(self, event: dict[str, Any]) -> None:
        line = json.dumps(event).encode() + b"\n"
        for loop, queue in self._streams:
            loop.call_soon_threadsafe(queue.put_nowait, line)

    # --- the HTTP side ------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/kv_events":
            if self._fallback is None:
                await _answer(send, 404, b'{"error": "not found"}')
                return
            await self._fallback(scope, receive, send)
            return
        await receive()  # the (empty) request body
        with self._lock:
            self.num_connections += 1
            if self.status != 200:
                status = self.status
            else:
                status = 200
                queue: asyncio.Queue[bytes] = asyncio.Queue()
                entry = (asyncio.get_running_loop(), queue)
                self._streams.append(entry)
                snapshot = {
                    "type": "snapshot",
                    "engine_id": self.engine_id,
                    "seq": self.seq,
                    "block_size": self.block_size,
                    "extra_key": self.extra_key.hex(),
                    "blocks": sorted(b.hex() for b in self.blocks),
                }
                first = json.dumps(snapshot) + "\n" + json.dumps({"type": "load", **self.load})
        if status != 200:
            await _answer(send, status, b'{"error": "no kv_events here"}')
            return
        try:
            await self._stream(first.encode() + b"\n", queue, receive, send)
        finally:
            with self._lock:
                self._streams.remove(entry)

    async def _stream(
        self, first: bytes, queue: asyncio.Queue[bytes], receive: Receive, send: Send
    ) -> None:
        headers = [(b"content-type", self.media_type)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": first, "more_body": True})
        disconnected = asyncio.ensure_future(receive())
        try:
            while True:
                line = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait(
                    {line, disconnected}, return_when=asyncio.FIRST_COMPLETED
                )
                if disconnected in done:
                    line.cancel()
                    return
                if line.result() == _CLOSE:
                    break
                await send({"type": "http.response.body", "body": line.result(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            disconnected.cancel()


async def _answer(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
