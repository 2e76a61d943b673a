"""``dns://host:port`` upstreams: a name that stands for every address it resolves to.

A Kubernetes headless Service answers with one address per ready pod, so resolving the
name again and again (every ``dns_refresh_s``) is how replicas join and leave. Each address
is one replica, ``http://<ip>:<port>`` (``http://[<ipv6>]:<port>``).

The resolver is asyncio's (``loop.getaddrinfo``, the system's resolver on a thread); tests
pass their own. A failed resolution, or one that finds nothing, keeps the last good set:
a DNS hiccup must not empty a pool that was serving.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

DNS_SCHEME = "dns://"
DEFAULT_DNS_REFRESH_S = 5.0

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""``(host, port)`` -> the IP addresses ``host`` resolves to now; raises ``OSError``."""


@dataclass(frozen=True)
class DnsUpstream:
    url: str  # as configured: dns://host:port
    host: str
    port: int

    @staticmethod
    def parse(url: str) -> DnsUpstream:
        """``dns://host:port`` -> its parts; ``ValueError`` naming what is wrong."""
        rest = url.removeprefix(DNS_SCHEME)
        host, sep, port = rest.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or "/" in rest or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"upstream {url!r} must be dns://host:port (e.g. dns://engine-small:8100)"
            )
        return DnsUpstream(url, host, int(port))

    def replica_base(self, address: str) -> str:
        """The base URL of the replica at ``address``."""
        if ipaddress.ip_address(address).version == 6:
            return f"http://[{address}]:{self.port}"
        return f"http://{address}:{self.port}"


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
