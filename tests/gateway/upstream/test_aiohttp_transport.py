"""The gateway's httpx transport over aiohttp, against real servers on this machine."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web

from gateway.upstream.aiohttp_transport import READ_BODY, AiohttpTransport
from gateway.upstream.sse_reader import read_body

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Serve = Callable[[Handler], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """``await serve(handler)``: the base URL of an aiohttp server answering with it."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.2)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def transport() -> AsyncIterator[AiohttpTransport]:
    made = AiohttpTransport(aiohttp.TCPConnector)
    yield made
    await made.aclose()


def post(url: str, *, read: bool, timeout: httpx.Timeout | None = None) -> httpx.Request:
    extensions: dict[str, object] = {"timeout": (timeout or httpx.Timeout(5.0)).as_dict()}
    if read:
        extensions[READ_BODY] = True
    return httpx.Request(
        "POST", url, content=b'{"x": 1}', headers={"x-tenant-id": "t"}, extensions=extensions
    )


async def test_a_read_answer_comes_whole_with_its_headers(
    serve: Serve, transport: AiohttpTransport
) -> None:
    seen: dict[str, Any] = {}

    async def handler(request: web.Request) -> web.Response:
        seen.update(headers=dict(request.headers), body=await request.read())
        return web.json_response({"ok": True}, status=201, headers={"x-engine": "e1"})

    base = await serve(handler)
    response = await transport.handle_async_request(post(f"{base}/v1/x", read=True))
    assert response.status_code == 201
    assert response.headers["x-engine"] == "e1"
    assert await read_body(response) == b'{"ok": true}'
    assert seen["body"] == b'{"x": 1}'
    headers = {k.lower(): v for k, v in seen["headers"].items()}
    assert headers["x-tenant-id"] == "t"
    assert "accept-encoding" not in headers  # nothing invites the engine to compress


async def test_a_stream_yields_each_write_as_it_comes(
    serve: Serve, transport: AiohttpTransport
) -> None:
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        await release.wait()
        await response.write(b"data: 2\n\n")
        return response

    base = await serve(handler)
    response = await transport.handle_async_request(post(f"{base}/s", read=False))
    assert isinstance(response.stream, httpx.AsyncByteStream)
    chunks = aiter(response.stream)
    assert await asyncio.wait_for(anext(chunks), 5) == b"data: 1\n\n"  # before the rest exists
    release.set()
    assert [chunk async for chunk in chunks] == [b"data: 2\n\n"]
    await response.aclose()


async def test_a_compressed_answer_is_left_to_httpx_to_decode(
    serve: Serve, transport: AiohttpTransport
) -> None:
    async def handler(request: web.Request) -> web.Response:
        body = gzip.compress(b'{"big": "answer"}')
        return web.Response(body=body, headers={"content-encoding": "gzip"})

    base = await serve(handler)
    response = await transport.handle_async_request(post(f"{base}/", read=True))
    assert await read_body(response) == b'{"big": "answer"}'
    await response.aclose()


async def test_nobody_listening_is_a_connect_error(transport: AiohttpTransport) -> None:
    with pytest.raises(httpx.ConnectError):
        await transport.handle_async_request(post("http://127.0.0.1:9/", read=True))


async def test_a_silent_engine_is_a_read_timeout(serve: Serve, transport: AiohttpTransport) -> None:
    async def handler(request: web.Request) -> web.Response:
        await asyncio.Event().wait()  # never answers
        return web.Response()

    base = await serve(handler)
    request = post(f"{base}/", read=True, timeout=httpx.Timeout(5.0, read=0.2))
    with pytest.raises(httpx.ReadTimeout):
        await transport.handle_async_request(request)


async def test_an_answer_cut_short_is_an_httpx_error() -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part of it")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(broken, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = AiohttpTransport(aiohttp.TCPConnector)
    try:
        with pytest.raises(httpx.TransportError):
            await transport.handle_async_request(post(f"http://127.0.0.1:{port}/", read=True))
        response = await transport.handle_async_request(
            post(f"http://127.0.0.1:{port}/", read=False)
        )
        assert isinstance(response.stream, httpx.AsyncByteStream)

        async def read_to_the_end(stream: httpx.AsyncByteStream) -> None:
            async for _ in stream:
                pass

        with pytest.raises(httpx.TransportError):
            await read_to_the_end(response.stream)
        await response.aclose()
    finally:
        await transport.aclose()
        server.close()
        await server.wait_closed()


async def test_closing_a_stream_early_drops_the_connection(
    serve: Serve, transport: AiohttpTransport
) -> None:
    left = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            while True:
                await response.write(b"data: tick\n\n")
                await asyncio.sleep(0.01)
        except (ConnectionResetError, asyncio.CancelledError):
            left.set()
            raise

    base = await serve(handler)
    response = await transport.handle_async_request(post(f"{base}/", read=False))
    assert isinstance(response.stream, httpx.AsyncByteStream)
    await anext(aiter(response.stream))
    await response.aclose()
    await asyncio.wait_for(left.wait(), 5)  # the engine sees its client gone, and aborts
