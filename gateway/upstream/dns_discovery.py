"""``dns://host:port`` upstreams: a name that stands for every address it resolves to.

A Kubernetes headless Service answers with one address per ready pod, so resolving the
name again and again (every ``dns_refresh_s``) is how replicas join and leave. Each address
is one replica, ``http://<ip>:<port>`` (``http://[<ipv6>]:<port>``).

The resolver is asyncio's (``loop.getaddrinfo``, the system's resolver on a thread); tests
pass their own. A failed resolution, or one that finds nothing, keeps the last good set:
a DNS hiccup must not empty a pool that was serving. The name itself, parsed, is a
`gateway.replica_settings.DnsUpstream`.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Sequence

from gateway.replica_settings import DnsUpstream

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""``(host, port)`` -> the IP addresses ``host`` resolves to now; raises ``OSError``."""


async def system_resolver(host: str, port: int) -> Sequence[str]:
    """Every address ``host`` resolves to for TCP, in the resolver's order, each once."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def resolve_bases(upstream: DnsUpstream, resolver: Resolver) -> tuple[str, ...]:
    """The replicas ``upstream`` names now, sorted (every gateway lists them alike).
    Raises ``OSError`` when the name does not resolve or resolves to nothing usable."""
    addresses = await resolver(upstream.host, upstream.port)
    bases = set()
    for address in addresses:
        try:
            bases.add(upstream.replica_base(address))
        except ValueError:
            continue  # not an IP address: nothing to connect to
    if not bases:
        raise OSError(f"{upstream.host} resolved to no address")
    return tuple(sorted(bases))
