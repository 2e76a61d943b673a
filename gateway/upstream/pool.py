"""The engines behind each model, reached through one pooled ``httpx.AsyncClient``.

The client's transport is aiohttp's (`gateway.upstream.aiohttp_transport`). A ``unix:/path.sock``
upstream gets a private host name (``http://uds-N.tollway.invalid``) mounted on an aiohttp
transport bound to that socket, so TCP and Unix-socket engines share one client and one set
of timeouts.

A model's replicas are live (`gateway.upstream.replica_set`): ``dns://`` upstreams are
resolved again and again, every replica is checked, and one that fails is ejected for a
while; `UpstreamPool.start` (the app's start-up) begins that.

`UpstreamPool.open` tries the available replicas in the order `replica_order` gives for the
request (the app's `gateway.upstream.replica_router.ReplicaRouter`: the model's
``replica_policy``, ``prefix``, ``least_loaded`` or ``round_robin``, decided by
`policies.replica_choice`; with no `replica_order`, `UpstreamPool.replicas`' rotation), and
moves on to the next one when an engine fails *before its first token*: a connection error,
a 5xx, or a stream that breaks before its first event with content. Once a token has been
relayed the request stays where it is. When every replica fails, a 500 answer (an engine
failed this request) is returned for the caller to report as a 502; only when none answered
is it a 503. A stream's events are read by `gateway.upstream.sse_reader`.

The request path hands a prebuilt ``httpx.Request`` (URL parsed once per replica and path,
the client's timeouts as its extension) straight to the replica's transport: an engine call
needs none of the client's redirects, auth, cookies or default headers. The aiohttp session
behind each transport keeps no cookie jar either. ``client`` (same transports) serves
everything else, e.g. the pool-load scrapes.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import httpx
import orjson

from gateway.errors import upstream_unavailable
from gateway.observability.metrics import GatewayMetrics
from gateway.replica_settings import DNS_SCHEME, DnsUpstream, ReplicaWatch
from gateway.settings import ModelSettings
from gateway.upstream.aiohttp_transport import READ_BODY, AiohttpTransport
from gateway.upstream.dns_discovery import Resolver, system_resolver
from gateway.upstream.replica_set import ReplicaSet, Upstream
from gateway.upstream.sse_reader import read_body, sse_batches

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=300.0, write=30.0, pool=30.0)
STOP_TIMEOUT = httpx.Timeout(2.0)  # asking an engine to stop a request


@dataclass
class UpstreamCall:
    """An open upstream response. For streams, ``events`` yields SSE ``data`` payloads in
    the batches they arrived in (one read of the upstream's bytes each, so a relay can
    write them to the client at once), starting with the ones read ahead while deciding
    whether to retry."""

    response: httpx.Response
    replica: str
    events: AsyncIterator[list[str]] | None = None
    body: bytes = b""
    num_failed_replicas: int = 0
    on_close: Callable[[], None] | None = field(default=None, repr=False)
    _is_closed: bool = field(default=False, repr=False)

    @property
    def status_code(self) -> int:
        return self.response.status_code

    async def aclose(self) -> None:
        """Close the upstream response: the engine sees the disconnect and aborts."""
        if self._is_closed:
            return
        self._is_closed = True
        if self.on_close is not None:
            self.on_close()
        if self.events is not None:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
        await self.response.aclose()


class ReplicaOrder(Protocol):
    """The hook through which the pool asks the order of a model's replicas for one request
    (`gateway.upstream.replica_router.ReplicaRouter`), and tells it where requests went."""

    async def order(
        self,
        model: str,
        replicas: list[str],
        body: Mapping[str, Any],
        prompt_token_ids: Sequence[int] | None = None,
    ) -> list[str]:
        """``replicas`` in the order to try them (best first); ``prompt_token_ids``: the
        prompt's engine ids where the caller has them already (the admitter's count)."""
        ...

    def sent(self, replica: str) -> None: ...

    def finished(self, replica: str) -> None: ...

    def forget(self, replica: str) -> None:
        """``replica`` has left every model (discovery): drop what is known of it."""
        ...


class UpstreamPool:
    def __init__(
        self,
        models: Mapping[str, ModelSettings],
        *,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        transport_factory: Callable[[str | None], httpx.AsyncBaseTransport] | None = None,
        watch: ReplicaWatch | None = None,
        resolver: Resolver = system_resolver,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        make = transport_factory or _aiohttp_transport
        tcp = self._tcp = make(None)
        mounts: dict[str, httpx.AsyncBaseTransport] = {}  # by a Unix socket's base URL
        upstreams: dict[str, list[Upstream]] = {}
        socket_hosts: dict[str, str] = {}
        for name, model in models.items():
            entries = upstreams[name] = []
            for url in model.upstreams:
                if url.startswith("unix:"):
                    path = url.removeprefix("unix:")
                    if path not in socket_hosts:
                        socket_hosts[path] = f"http://uds-{len(socket_hosts)}.tollway.invalid"
                        mounts[socket_hosts[path]] = make(path)
                    entries.append(socket_hosts[path])
                elif url.startswith(DNS_SCHEME):
                    entries.append(DnsUpstream.parse(url))
                else:
                    entries.append(url.rstrip("/"))
        self._mounts = mounts
        self.replica_set = ReplicaSet(
            upstreams,
            watch or ReplicaWatch(),
            resolver=resolver,
            metrics=metrics,
            on_leave=self._forget,
        )
        self.client = httpx.AsyncClient(
            transport=tcp, mounts=mounts, timeout=timeout, trust_env=False
        )
        self._stream_extensions = {"timeout": timeout.as_dict()}
        self._extensions = {**self._stream_extensions, READ_BODY: True}
        self._stop_extensions = {"timeout": STOP_TIMEOUT.as_dict(), READ_BODY: True}
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        self._turns = {name: itertools.count() for name in models}
        self.replica_order: ReplicaOrder | None = None  # None: `replicas`' rotation as it is

    async def start(self) -> None:
        """Resolve the ``dns://`` upstreams and check every replica, then keep doing so."""
        await self.replica_set.start(self.client)

    def replicas(self, model: str) -> list[str]:
        """The model's available replicas (`ReplicaSet.available`), rotated by one on every
        call: the order `replica_order` starts from (its ``round_robin`` policy keeps it)."""
        bases = self.replica_set.available(model)
        if not bases:
            return []  # a dns:// name that has resolved to nothing yet
        start = next(self._turns[model]) % len(bases)
        return [*bases[start:], *bases[:start]]

    async def open(
        self,
        model: str,
        path: str,
        body: dict[str, Any],
        headers: Mapping[str, str],
        *,
        is_stream: bool,
        on_replica_error: Callable[[str, str], None] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> UpstreamCall:
        """The first replica that answers, tried in `replica_order`'s order; raises a 503
        `ApiError` if none does.

        A 4xx answer is returned (the engine's own error for this request, which the caller
        rewrites as the gateway's). A 500 is tried on the next replica; if no replica does
        better, the last 500 is returned (the engines failed this request, which the caller
        reports as a 502, not a 503).
        """
        payload = json.dumps(body).encode()
        request_headers = {**headers, "content-type": "application/json"}
        num_failed = 0
        failed_answer: UpstreamCall | None = None
        replicas = self.replicas(model)
        hook = self.replica_order  # the order, and what is in flight where
        if hook is not None:
            replicas = await hook.order(model, replicas, body, prompt_token_ids)
        for base in replicas:
            if hook is not None:
                hook.sent(base)  # in flight until this attempt ends, or its call closes
            request = httpx.Request(
                "POST",
                self._url(base, path),
                content=payload,
                headers=request_headers,
                extensions=self._stream_extensions if is_stream else self._extensions,
            )
            response: httpx.Response | None = None
            try:
                response = await self._transport(base).handle_async_request(request)
                if response.status_code >= 500:
                    if response.status_code == 500:
                        failed_answer = UpstreamCall(response, base, body=await read_body(response))
                    raise _ReplicaFailed(f"status {response.status_code}")
                call = UpstreamCall(response, base, num_failed_replicas=num_failed)
                if is_stream and response.status_code < 400:
                    call.events = await _read_ahead(sse_batches(response))
                    if hook is not None:  # a stream is in flight until its call closes
                        call.on_close, hook = functools.partial(hook.finished, base), None
                else:
                    call.body = await read_body(response)
                    await response.aclose()
                self.replica_set.record_success(base)
                return call
            except (httpx.HTTPError, _ReplicaFailed) as exc:
                num_failed += 1
                self.replica_set.record_failure(model, base)
                reason = type(exc).__name__ if isinstance(exc, httpx.HTTPError) else str(exc)
                logger.warning("upstream %s for %s failed: %s", base, model, reason)
                if on_replica_error is not None:
                    on_replica_error(model, reason)
                if response is not None:
                    await response.aclose()
            finally:
                if hook is not None:
                    hook.finished(base)
        if failed_answer is not None:
            failed_answer.num_failed_replicas = num_failed
            return failed_answer
        raise upstream_unavailable(model)

    async def stop(self, model: str, request_id: str) -> bool:
        """Ask every replica of ``model`` to stop the generation sent with ``request_id``
        (a Tollway engine's ``POST /abort_request``; its answer to that request then comes
        at once, with the usage of what it generated). True if a replica had it in flight;
        False for engines without the endpoint and for any failure."""
        payload = json.dumps({"request_id": request_id}).encode()
        was_stopped = False
        for base in self.replica_set.members(model):
            request = httpx.Request(
                "POST",
                self._url(base, "/abort_request"),
                content=payload,
                headers={"content-type": "application/json"},
                extensions=self._stop_extensions,
            )
            try:
                response = await self._transport(base).handle_async_request(request)
                try:
                    answer = (
                        json.loads(await response.aread()) if response.status_code == 200 else {}
                    )
                finally:
                    await response.aclose()
            except (httpx.HTTPError, ValueError):
                continue
            was_stopped = was_stopped or (
                isinstance(answer, dict) and answer.get("aborted") is True
            )
        return was_stopped

    async def aclose(self) -> None:
        await self.replica_set.aclose()
        await self.client.aclose()  # closes every transport, mounted ones included

    def _transport(self, base: str) -> httpx.AsyncBaseTransport:
        """A Unix socket's own transport; the shared TCP one for every other replica (so a
        replica that joins later needs nothing set up)."""
        return self._mounts.get(base, self._tcp)

    def _forget(self, base: str) -> None:
        """A replica left (DNS): drop its parsed URLs, so churn does not grow the cache, and
        what the replica order knows of it (its prefix-cache stream)."""
        for key in [key for key in self._urls if key[0] == base]:
            del self._urls[key]
        if self.replica_order is not None:
            self.replica_order.forget(base)

    def _url(self, base: str, path: str) -> httpx.URL:
        url = self._urls.get((base, path))
        if url is None:
            url = self._urls[base, path] = httpx.URL(base + path)
        return url


class _ReplicaFailed(Exception):
    pass


MAX_CONNECTIONS = 1000  # per transport (each Unix socket, and all TCP engines together)
KEEPALIVE_S = 5.0  # an idle connection to an engine is closed after this


def _aiohttp_transport(uds: str | None) -> httpx.AsyncBaseTransport:
    def connector() -> aiohttp.BaseConnector:  # called on first use, inside the event loop
        if uds is not None:
            return aiohttp.UnixConnector(
                path=uds, limit=MAX_CONNECTIONS, keepalive_timeout=KEEPALIVE_S
            )
        return aiohttp.TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=KEEPALIVE_S)

    return AiohttpTransport(connector)


async def _read_ahead(batches: AsyncIterator[list[str]]) -> AsyncIterator[list[str]]:
    """Read events until one carries a token, an error or the end; fail (so the caller
    retries elsewhere) if the stream breaks or reports an error before that."""
    buffered: list[list[str]] = []
    async for batch in batches:
        buffered.append(batch)
        for payload in batch:
            if _is_error(payload):
                raise _ReplicaFailed("error event before the first token")
            if _has_substance(payload):
                return _chain(buffered, batches)
    if not buffered or buffered[-1][-1] != "[DONE]":
        raise _ReplicaFailed("stream ended before the first token")
    return _chain(buffered, batches)


async def _chain(
    first: list[list[str]], rest: AsyncIterator[list[str]]
) -> AsyncIterator[list[str]]:
    for batch in first:
        yield batch
    async for batch in rest:
        yield batch


def _is_error(payload: str) -> bool:
    return payload.startswith('{"error"')


def _has_substance(payload: str) -> bool:
    """True for anything but a chat role chunk: content, a piece of a tool call (its content
    is null), a finish reason, usage, [DONE]."""
    if payload == "[DONE]":
        return True
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return True
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        if delta is None or delta.get("content") or delta.get("tool_calls"):
            return True
        if choice.get("finish_reason"):
            return True
    return chunk.get("usage") is not None
