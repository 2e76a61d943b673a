"""How an alert webhook is signed, and how a receiver checks it (the Standard Webhooks scheme).

Every delivery carries three headers::

    webhook-id: evt_3f1c...          the event's id: the same on every attempt (idempotency)
    webhook-timestamp: 1764730000    unix seconds when this attempt was signed
    webhook-signature: v1,<base64>   HMAC-SHA256 over "{id}.{timestamp}.{body}"

The HMAC key is the configured secret: for ``whsec_<base64>`` the bytes the base64 spells
(as the Standard Webhooks libraries read it, so ``standardwebhooks.Webhook(secret).verify``
accepts our deliveries), for any other string its UTF-8 bytes. The body is signed as the
exact bytes sent. To verify, a receiver recomputes the HMAC over the id, timestamp and raw
body it received, compares it in constant time with each ``v1,`` entry of the signature
header (space-separated; more than one during a secret rotation), and refuses a timestamp
more than a few minutes from its own clock (a replayed old delivery). `verify` does exactly
that. Binding the timestamp and id into the signature is what makes the timestamp check
and the idempotency id trustworthy.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping

SECRET_PREFIX = "whsec_"
DEFAULT_TOLERANCE_S = 300  # the Standard Webhooks default: five minutes either way


class InvalidSignature(ValueError):
    """A delivery that does not verify: wrong signature, missing header or stale timestamp."""


def signing_key(secret: str) -> bytes:
    if secret.startswith(SECRET_PREFIX):
        try:
            return base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
        except binascii.Error:
            pass  # not base64 after all: a plain string that happens to start with whsec_
    return secret.encode("utf-8")


def signature(secret: str, event_id: str, timestamp: int, body: bytes) -> str:
    """``v1,<base64 HMAC-SHA256 of "{event_id}.{timestamp}.{body}">``."""
    signed = f"{event_id}.{timestamp}.".encode() + body
    digest = hmac.new(signing_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def signed_headers(secret: str, event_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {
        "content-type": "application/json",
        "webhook-id": event_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(secret, event_id, timestamp, body),
    }


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    now: float,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> str:
    """The event id of a delivery that verifies; `InvalidSignature` otherwise. ``headers``:
    the request's headers (lower-case names, as Starlette and httpx give them)."""
    event_id = headers.get("webhook-id")
    timestamp_text = headers.get("webhook-timestamp")
    signatures = headers.get("webhook-signature")
    if not event_id or not timestamp_text or not signatures:
        raise InvalidSignature("missing webhook-id, webhook-timestamp or webhook-signature")
    try:
        timestamp = int(timestamp_text)
    except ValueError:
        raise InvalidSignature(
            f"webhook-timestamp {timestamp_text!r} is not unix seconds"
        ) from None
    if abs(now - timestamp) > tolerance_s:
        raise InvalidSignature(f"webhook-timestamp {timestamp} is more than {tolerance_s} s off")
    expected = signature(secret, event_id, timestamp, body)
    for candidate in signatures.split():
        if candidate.startswith("v1,") and hmac.compare_digest(candidate, expected):
            return event_id
    raise InvalidSignature("no v1 signature matches the id, timestamp and body")
