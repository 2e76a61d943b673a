"""The ``alerts:`` settings: where budget alerts go, how they are signed, and how hard to try.

::

    alerts:
      webhook_url: https://hooks.example.com/tollway   # TOLLWAY_ALERT_WEBHOOK_URL
      webhook_secret: whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw  # TOLLWAY_ALERT_WEBHOOK_SECRET
      thresholds: [50, 80, 100]   # percents of each budget's limit (default)
      retry_first_delay_s: 1      # a refused delivery is tried again after this long,
      retry_max_delay_s: 300      # doubling up to this,
      max_attempts: 20            # this many times in all; then the event is "failed"
      timeout_s: 10               # one delivery's longest wait for the receiver
      poll_interval_s: 5          # how often the outbox is read for events due

No ``alerts:`` (and no ``TOLLWAY_ALERT_WEBHOOK_URL``): no thresholds are checked and nothing
is sent. The secret is better given by the environment than in the file. A secret spelt
``whsec_<base64>`` is used as the Standard Webhooks libraries use it (the bytes the base64
spells), so their verifiers work unchanged; any other string is used as its UTF-8 bytes
(see `gateway.alerts.webhook_signature`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.budget_alerts import DEFAULT_ALERT_THRESHOLDS, check_thresholds

_ENV_FIELDS = {
    "TOLLWAY_ALERT_WEBHOOK_URL": "webhook_url",
    "TOLLWAY_ALERT_WEBHOOK_SECRET": "webhook_secret",
}
_FLOAT_FIELDS = ("retry_first_delay_s", "retry_max_delay_s", "timeout_s", "poll_interval_s")
_FIELDS = {"webhook_url", "webhook_secret", "thresholds", "max_attempts", *_FLOAT_FIELDS}
MIN_SECRET_LENGTH = 16


@dataclass(frozen=True)
class AlertSettings:
    webhook_url: str
    webhook_secret: str = field(repr=False)  # never in a log line or a traceback
    thresholds: tuple[int, ...] = DEFAULT_ALERT_THRESHOLDS
    retry_first_delay_s: float = 1.0
    retry_max_delay_s: float = 300.0
    max_attempts: int = 20
    timeout_s: float = 10.0
    poll_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.webhook_url.startswith(("http://", "https://")):
            raise ValueError(
                f"alerts.webhook_url must be an http:// or https:// URL, got {self.webhook_url!r}"
            )
        if len(self.webhook_secret) < MIN_SECRET_LENGTH:
            raise ValueError(
                f"alerts.webhook_secret must be at least {MIN_SECRET_LENGTH} characters "
                "(set it, or TOLLWAY_ALERT_WEBHOOK_SECRET, to a random string: "
                "python -c 'import secrets;print(\"whsec_\" + secrets.token_urlsafe(24))')"
            )
        object.__setattr__(self, "thresholds", check_thresholds(self.thresholds))
        if not 0 < self.retry_first_delay_s <= self.retry_max_delay_s:
            raise ValueError(
                "alerts: need 0 < retry_first_delay_s <= retry_max_delay_s, got "
                f"{self.retry_first_delay_s} and {self.retry_max_delay_s}"
            )
        if self.max_attempts < 1:
            raise ValueError(f"alerts.max_attempts must be at least 1, got {self.max_attempts}")
        for name in ("timeout_s", "poll_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"alerts.{name} must be > 0 seconds, got {getattr(self, name)}")

    def retry_delay_s(self, num_attempts: int) -> float:
        """How long to wait after the ``num_attempts``-th failed delivery: doubling from
        ``retry_first_delay_s``, capped at ``retry_max_delay_s``."""
        exponent = min(max(num_attempts - 1, 0), 62)
        return float(min(self.retry_first_delay_s * 2**exponent, self.retry_max_delay_s))


def parse_alert_settings(raw: Any, env: Mapping[str, str]) -> AlertSettings | None:
    """``alerts:`` from YAML with the ``TOLLWAY_ALERT_*`` overrides; None when no webhook URL
    is configured anywhere."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError("`alerts:` must be a mapping with webhook_url and webhook_secret")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise ValueError(
            f"alerts: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_FIELDS))}"
        )
    values = dict(raw)
    for var, name in _ENV_FIELDS.items():
        if env.get(var):
            values[name] = env[var]
    if not values.get("webhook_url"):
        if values:
            raise ValueError("alerts: webhook_url is required (or TOLLWAY_ALERT_WEBHOOK_URL)")
        return None
    kwargs: dict[str, Any] = {
        "webhook_url": str(values["webhook_url"]),
        "webhook_secret": str(values.get("webhook_secret") or ""),
    }
    for name in (*_FLOAT_FIELDS, "max_attempts"):
        value = values.get(name)
        if value is None:
            continue
        try:
            kwargs[name] = int(value) if name == "max_attempts" else float(value)
        except (TypeError, ValueError):
            raise ValueError(f"alerts.{name}: cannot use {value!r}") from None
    thresholds = values.get("thresholds")
    if thresholds is not None:
        if not isinstance(thresholds, list):
            raise ValueError(f"alerts.thresholds must be a list of percents, got {thresholds!r}")
        kwargs["thresholds"] = tuple(thresholds)
    return AlertSettings(**kwargs)
