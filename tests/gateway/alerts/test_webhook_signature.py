"""The documented verification accepts what we sign and detects anything else."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from gateway.alerts.webhook_signature import (
    InvalidSignature,
    signed_headers,
    signing_key,
    verify,
)

SECRET = "whsec_" + base64.b64encode(b"k" * 24).decode()
BODY = b'{"id":"evt_1","type":"budget.threshold_crossed"}'
NOW = 1_764_730_000


def test_a_signed_delivery_verifies() -> None:
    headers = signed_headers(SECRET, "evt_1", NOW, BODY)
    assert verify(SECRET, headers, BODY, now=NOW + 10) == "evt_1"


def test_the_signature_is_hmac_sha256_over_id_timestamp_and_body() -> None:
    """The scheme as documented, computed here from its definition."""
    digest = hmac.new(b"k" * 24, b"evt_1.%d." % NOW + BODY, hashlib.sha256).digest()
    expected = "v1," + base64.b64encode(digest).decode()
    assert signed_headers(SECRET, "evt_1", NOW, BODY)["webhook-signature"] == expected
    assert signing_key("plain-secret-string") == b"plain-secret-string"


WRONG_SECRET = "whsec_" + base64.b64encode(b"x" * 24).decode()
TAMPERED = BODY.replace(b"evt_1", b"evt_2")


@pytest.mark.parametrize(
    ("secret", "body", "change", "message"),
    [
        (WRONG_SECRET, BODY, {}, "no v1 signature"),
        (SECRET, TAMPERED, {}, "no v1 signature"),
        (SECRET, BODY, {"webhook-id": "evt_2"}, "no v1 signature"),
        (SECRET, BODY, {"webhook-timestamp": str(NOW + 1)}, "no v1 signature"),
        (SECRET, BODY, {"webhook-timestamp": str(NOW - 301)}, "more than 300"),
        (SECRET, BODY, {"webhook-timestamp": "yesterday"}, "not unix seconds"),
        (SECRET, BODY, {"webhook-signature": ""}, "missing"),
        (SECRET, BODY, {"webhook-signature": "v2,abc"}, "no v1 signature"),
    ],
)
def test_a_wrong_signature_is_detected(
    secret: str, body: bytes, change: dict[str, str], message: str
) -> None:
    """Signed with ``secret`` over BODY, then received as ``body`` with ``change``d headers
    and verified with the right secret."""
    headers = {**signed_headers(secret, "evt_1", NOW, BODY), **change}
    with pytest.raises(InvalidSignature, match=message):
        verify(SECRET, headers, body, now=NOW)


def test_one_of_several_signatures_may_match() -> None:
    """During a secret rotation a sender may send a signature per secret."""
    old = signed_headers("whsec_" + base64.b64encode(b"o" * 24).decode(), "evt_1", NOW, BODY)
    new = signed_headers(SECRET, "evt_1", NOW, BODY)
    headers = {**new, "webhook-signature": f"{old['webhook-signature']} {new['webhook-signature']}"}
    assert verify(SECRET, headers, BODY, now=NOW) == "evt_1"
