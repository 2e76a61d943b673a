"""Reading an engine's answer off the wire: a stream's server-sent events, in the batches
they arrived in, or a whole (non-streamed) body.

Both read the bytes as the transport delivers them (`_raw_chunks`): httpx's decoder and
re-chunking cost more than the rest of reading a short answer, and there is nothing for them
to undo unless the answer is compressed (the gateway asks for no compression).

Events are cut from the raw bytes (any of the three SSE line endings), which costs a few
``find`` calls per event instead of a text decoder and a line splitter per line. Only the
gateway reads SSE (the engine only writes it, with `openai_protocol.sse`), so this lives with
the pool, on the gateway's side of the wire.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx


async def sse_batches(response: httpx.Response) -> AsyncIterator[list[str]]:
    """The ``data`` payload of each server-sent event, in order (``[DONE]`` included), one
    non-empty list per read that completed any: events that arrive together stay together."""
    pending = b""
    async for chunk in _raw_chunks(response):
        pending += chunk
        if b"\r" in pending:
            pending = _to_lf(pending)
        start, batch = 0, []
        while (end := pending.find(b"\n\n", start)) >= 0:
            data = _event_data(pending[start:end])
            if data is not None:
                batch.append(data)
            start = end + 2
        pending = pending[start:]
        if batch:
            yield batch
    data = _event_data(_to_lf(pending, is_final=True))
    if data is not None:
        yield [data]


async def read_body(response: httpx.Response) -> bytes:
    """The whole body, decoded, as ``response.aread()`` gives it."""
    return b"".join([chunk async for chunk in _raw_chunks(response)])


def _raw_chunks(response: httpx.Response) -> AsyncIterator[bytes]:
    """The body as the transport delivers it, skipping httpx's decoder and re-chunking when
    there is no encoding to undo."""
    stream = response.stream
    if "content-encoding" in response.headers or not isinstance(stream, httpx.AsyncByteStream):
        return response.aiter_bytes()
    return aiter(stream)


def _to_lf(text: bytes, *, is_final: bool = False) -> bytes:
    """CRLF and CR line endings as LF; a CR last in a chunk may be half of a CRLF: kept."""
    text = text.replace(b"\r\n", b"\n")
    if is_final or not text.endswith(b"\r"):
        return text.replace(b"\r", b"\n")
    return text[:-1].replace(b"\r", b"\n") + b"\r"


def _event_data(block: bytes) -> str | None:
    """The joined ``data`` lines of one event block; ``None`` if it has none."""
    if block.startswith(b"data: ") and b"\n" not in block:  # the usual one-line event
        return block[6:].decode()
    lines = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line[:5] == b"data:"]
    return b"\n".join(lines).decode() if lines else None
