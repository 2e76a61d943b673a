"""``dns://host:port`` upstreams: the replicas an answer stands for."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gateway.replica_settings import DnsUpstream
from gateway.upstream.dns_discovery import resolve_bases, system_resolver


async def test_each_address_is_one_replica_sorted_once() -> None:
    async def resolver(host: str, port: int) -> Sequence[str]:
        assert (host, port) == ("engine", 8100)
        return ["10.0.0.3", "10.0.0.1", "fd00::2", "10.0.0.1", "not-an-ip"]

    bases = await resolve_bases(DnsUpstream.parse("dns://engine:8100"), resolver)
    assert bases == ("http://10.0.0.1:8100", "http://10.0.0.3:8100", "http://[fd00::2]:8100")


async def test_a_name_with_no_usable_address_is_a_failure() -> None:
    async def resolver(host: str, port: int) -> Sequence[str]:
        return []

    with pytest.raises(OSError, match="no address"):
        await resolve_bases(DnsUpstream.parse("dns://engine:8100"), resolver)


async def test_the_system_resolver_answers_an_address_literal_without_a_lookup() -> None:
    assert list(await system_resolver("127.0.0.1", 8100)) == ["127.0.0.1"]
