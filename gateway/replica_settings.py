"""Where a model's engine replicas are and how they are watched: the settings' replica values.

An upstream is ``http(s)://host:port``, ``unix:/path.sock`` or ``dns://host:port``
(`DnsUpstream`: a name that stands for every address it resolves to). `ReplicaWatch` holds the
top-level keys that say how often names are resolved and replicas checked, and its
`EjectionRule` how failures eject a replica. The settings validate them at start-up; the
upstream pool (`gateway.upstream`) acts on them.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from gateway.defaults import (
    DEFAULT_DNS_REFRESH_S,
    DEFAULT_EJECTION_BACKOFF_MAX_S,
    DEFAULT_EJECTION_BACKOFF_S,
    DEFAULT_EJECTION_FAILURES,
    DEFAULT_HEALTH_CHECK_INTERVAL_S,
)

DNS_SCHEME = "dns://"


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


@dataclass(frozen=True)
class EjectionRule:
    """``failures_to_eject`` failures in a row eject a replica for ``backoff_s``, doubled per
    ejection in a row up to ``backoff_max_s`` (`gateway.upstream.replica_health`)."""

    failures_to_eject: int = DEFAULT_EJECTION_FAILURES
    backoff_s: float = DEFAULT_EJECTION_BACKOFF_S
    backoff_max_s: float = DEFAULT_EJECTION_BACKOFF_MAX_S

    def __post_init__(self) -> None:
        if isinstance(self.failures_to_eject, bool) or self.failures_to_eject < 1:
            raise ValueError(
                f"ejection_failures must be an integer >= 1, got {self.failures_to_eject!r}"
            )
        if not self.backoff_s > 0:
            raise ValueError(f"ejection_backoff_s must be > 0, got {self.backoff_s}")
        if not self.backoff_max_s >= self.backoff_s:
            raise ValueError(
                f"ejection_backoff_max_s ({self.backoff_max_s}) must be at least "
                f"ejection_backoff_s ({self.backoff_s})"
            )

    def backoff(self, num_ejections: int) -> float:
        """How long the ``num_ejections``-th ejection in a row (1, 2, ...) lasts."""
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** min(num_ejections - 1, 64))


@dataclass(frozen=True)
class ReplicaWatch:
    """How replicas are found and checked (the gateway settings' top-level keys)."""

    dns_refresh_s: float = DEFAULT_DNS_REFRESH_S
    health_check_interval_s: float = DEFAULT_HEALTH_CHECK_INTERVAL_S  # 0: no active checks
    ejection: EjectionRule = field(default_factory=EjectionRule)

    def __post_init__(self) -> None:
        if not self.dns_refresh_s > 0:
            raise ValueError(f"dns_refresh_s must be > 0, got {self.dns_refresh_s}")
        if not self.health_check_interval_s >= 0:
            raise ValueError(
                f"health_check_interval_s must be >= 0 (0: no active health checks), "
                f"got {self.health_check_interval_s}"
            )
