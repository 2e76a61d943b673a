"""An httpx transport over aiohttp, cut to what the gateway's engine calls need.

httpx's own transport (httpcore) tops out near 370 requests/s on the development machine and
aiohttp near 8,800, so the gateway keeps httpx's API (``httpx.Request`` in, ``httpx.Response``
out, httpx's exceptions) over an aiohttp session. httpx-aiohttp's adapter does the same for
any use of httpx; this one does less per call, which is most of what an engine call costs:

- Timeouts come from the request's ``timeout`` extension, as with httpcore, converted to
  aiohttp's once per distinct value rather than on every call.
- A request sent with ``READ_BODY`` in its extensions comes back with its body already
  read (one ``read()`` of aiohttp's) and its connection back in the pool; its
  ``response.stream`` yields that body in one piece. Without it, ``response.stream``
  yields the bytes as aiohttp receives them, one chunk per read. (Iterating
  ``response.stream`` skips httpx's decoder and chunker; ``aread`` works as usual.)
- Nothing asks for compression (no ``Accept-Encoding``), and aiohttp decodes nothing: an
  answer that comes compressed anyway keeps its ``Content-Encoding`` header, and httpx's
  own decoders (``aread``, ``aiter_bytes``) undo it. ``READ_BODY`` then leaves it as a
  stream, for httpx to decode.

aiohttp's errors become httpx's (``ConnectError``, ``ReadTimeout``, ``ReadError``, ...), so
callers catch ``httpx.HTTPError`` for every transport failure, as with any httpx transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp
import httpx

READ_BODY = "tollway.read_body"  # extension: read the whole answer before returning

_NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent")


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One aiohttp session over the connector that ``connector`` makes (on first use, inside
    the event loop): no cookie jar, no automatic headers."""

    def __init__(self, connector: Callable[[], aiohttp.BaseConnector]) -> None:
        self._make_connector = connector
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[tuple[Any, ...], aiohttp.ClientTimeout] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        session = self._session
        if session is None:
            session = self._session = aiohttp.ClientSession(
                connector=self._make_connector(),
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=_NO_AUTO_HEADERS,
            )
        extensions = request.extensions
        try:
            response = await session.request(
                request.method,
                str(request.url),
                headers=request.headers.multi_items(),
                data=request.content or None,
                allow_redirects=False,
                auto_decompress=False,
                compress=None,
                timeout=self._timeout(extensions.get("timeout")),
            )
            if extensions.get(READ_BODY) and "content-encoding" not in response.headers:
                try:
                    body = await response.read()
                finally:
                    response.release()
                return httpx.Response(
                    response.status,
                    headers=response.raw_headers,
                    stream=httpx.ByteStream(body),
                    request=request,
                )
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _to_httpx(exc, request) from exc
        return httpx.Response(
            response.status,
            headers=response.raw_headers,
            stream=_Chunks(response, request),
            request=request,
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _timeout(self, timeout: Mapping[str, float | None] | None) -> aiohttp.ClientTimeout:
        """httpx's ``{connect, read, write, pool}`` as aiohttp's timeouts (write: no such)."""
        timeout = timeout or {}
        key = tuple(timeout.items())  # the pool passes the same dict every time
        found = self._timeouts.get(key)
        if found is None:
            found = self._timeouts[key] = aiohttp.ClientTimeout(
                sock_connect=timeout.get("connect"),
                sock_read=timeout.get("read"),
                connect=timeout.get("pool"),
            )
        return found


class _Chunks(httpx.AsyncByteStream):
    """An answer's body as aiohttp receives it; closing it releases the connection (or
    closes it, if the body was not read to its end)."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while chunk := await content.readany():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _to_httpx(exc, self._request) from exc

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # back to the pool for the next call
        else:
            self._response.close()  # the engine sees the disconnect and aborts


def _to_httpx(exc: BaseException, request: httpx.Request) -> httpx.TransportError:
    """The httpx error for an aiohttp one (most specific first)."""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError(message, request=request)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, aiohttp.SocketTimeoutError | asyncio.TimeoutError):
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ClientOSError):
        return httpx.ReadError(message, request=request)
    return httpx.RemoteProtocolError(message, request=request)
