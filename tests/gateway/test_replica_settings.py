"""The settings' replica values: ``dns://host:port`` names, and the ejection rule."""

from __future__ import annotations

import pytest

from gateway.replica_settings import DnsUpstream, EjectionRule


def test_parse() -> None:
    assert DnsUpstream.parse("dns://engine-small:8100") == DnsUpstream(
        "dns://engine-small:8100", "engine-small", 8100
    )
    assert DnsUpstream.parse("dns://[::1]:80").host == "::1"


@pytest.mark.parametrize(
    "url",
    ["dns://engine", "dns://engine:", "dns://:8100", "dns://e:0", "dns://e:1/v1", "dns://e:x"],
)
def test_parse_refuses_what_is_not_host_and_port(url: str) -> None:
    with pytest.raises(ValueError, match="must be dns://host:port"):
        DnsUpstream.parse(url)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"failures_to_eject": 0}, "ejection_failures"),
        ({"backoff_s": 0.0}, "ejection_backoff_s"),
        ({"backoff_s": 2.0, "backoff_max_s": 1.0}, "ejection_backoff_max_s"),
    ],
)
def test_bad_rules_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EjectionRule(**kwargs)  # type: ignore[arg-type]
