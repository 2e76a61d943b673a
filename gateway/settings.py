"""The gateway's one frozen settings object, read from YAML with ``TOLLWAY_*`` overrides.

::

    host: 127.0.0.1               # gateway/defaults.py: DEFAULT_HOST
    port: 8000                    # DEFAULT_PORT
    data_dir: tollway-data        # DEFAULT_DATA_DIR
    database_url: null            # null: sqlite:///<data_dir>/tollway.db
    redis_url: null               # null: budgets and rate limits in process (one gateway)
    redis_connect_timeout_s: 0.5  # longest wait to connect to Redis
    redis_timeout_s: 0.5          # longest wait for any one Redis reply
    redis_failure_mode: closed    # Redis unreachable: closed = 503; open = admit uncounted
    admin_key_hash: null          # sha256 hex of the admin key
    metrics_token_hash: null      # sha256 hex of a token for GET /metrics (see below)
    reservation_ttl_s: 600
    auth_cache_ttl_s: 10          # longest an API key is trusted from memory; 0: read every time
    auth_stale_ttl_s: 600         # database unreachable: verified keys keep working this long
    auth_unknown_key_ttl_s: 5     # a key made around the admin API waits at most this; 0: no filter
    max_body_bytes: 1048576
    currency: USD                 # the code prices and money budgets are in (ISO 4217)
    otel_endpoint: null           # null: no span export
    log_prompts: false
    dns_refresh_s: 5              # how often a dns:// upstream is resolved again
    health_check_interval_s: 5    # GET /ready of every replica this often; 0: never
    ejection_failures: 3          # consecutive failures that eject a replica ...
    ejection_backoff_s: 1         # ... for this long, doubling per ejection in a row ...
    ejection_backoff_max_s: 30    # ... up to this; a success resets it
    drain_delay_s: 5              # SIGTERM: keep serving, /ready 503, this long; then
    drain_grace_s: 30             # stop taking requests, let those in flight finish this long
    header_timeout_s: 10          # a request's headers must arrive within this long; else 408
    body_timeout_s: 30            # its body within this long of its headers (total); else 408
    max_connections: 1000         # connections open per process; a request beyond: 503
    models:
      small:
        upstreams: [unix:/run/tollway/small.sock, http://10.0.0.2:8100, dns://engine-small:8100]
        context_window: 8192
        checkpoint: data/models/small   # exact token counts; null counts with cl100k_base
        replica_policy: prefix          # or least_loaded, round_robin (policies/replica_choice.py)
        prices: {input: 100000, cached_input: 25000, output: 400000}  # micros per 1M tokens
        upstream_model: null            # the id sent upstream as "model"; null: the name
    rollouts:                         # a public name -> versions (models above) by weight
      large: {large-v1: 95, large-v2: 5}   # see gateway/rollouts.py
    routing:
      aliases: {auto: {small: small, large: large}}
      long_prompt_tokens: 4096
    alerts:                           # budget alerts by signed webhook (gateway/alert_settings.py)
      webhook_url: https://hooks.example.com/tollway
      thresholds: [50, 80, 100]
    console:                          # the admins' console at /ui (gateway/console_section.py)
      session_secret: null            # the same on every replica; null: one per process

Environment variables override the scalar fields: ``TOLLWAY_HOST``, ``TOLLWAY_PORT``,
``TOLLWAY_DATA_DIR``, ``TOLLWAY_DATABASE_URL``, ``TOLLWAY_REDIS_URL``,
``TOLLWAY_ADMIN_KEY_HASH``, ``TOLLWAY_METRICS_TOKEN_HASH``, ``TOLLWAY_RESERVATION_TTL_S``,
``TOLLWAY_AUTH_CACHE_TTL_S``, ``TOLLWAY_MAX_BODY_BYTES``, ``TOLLWAY_OTEL_ENDPOINT``,
``TOLLWAY_LOG_PROMPTS``, ``TOLLWAY_REDIS_CONNECT_TIMEOUT_S``, ``TOLLWAY_REDIS_TIMEOUT_S``,
``TOLLWAY_REDIS_FAILURE_MODE``, ``TOLLWAY_AUTH_STALE_TTL_S``, ``TOLLWAY_DNS_REFRESH_S``,
``TOLLWAY_HEALTH_CHECK_INTERVAL_S``, ``TOLLWAY_EJECTION_FAILURES``,
``TOLLWAY_EJECTION_BACKOFF_S``, ``TOLLWAY_EJECTION_BACKOFF_MAX_S``, ``TOLLWAY_DRAIN_DELAY_S``,
``TOLLWAY_DRAIN_GRACE_S``, ``TOLLWAY_HEADER_TIMEOUT_S``, ``TOLLWAY_BODY_TIMEOUT_S``,
``TOLLWAY_MAX_CONNECTIONS``, ``TOLLWAY_CURRENCY`` (an empty value sets an optional field to
null); and in their sections ``TOLLWAY_ALERT_WEBHOOK_URL``, ``TOLLWAY_ALERT_WEBHOOK_SECRET`` and
``TOLLWAY_CONSOLE_SESSION_SECRET``.

Engine replicas (see docs/operations.md): an upstream is ``http(s)://host:port``,
``unix:/path.sock`` or ``dns://host:port``, a name resolved at start-up and every
``dns_refresh_s``, each address one replica ``http://ip:port`` (a Kubernetes headless
Service lists one per ready pod); replicas join and leave without a restart, and a failed
resolution keeps the last good set. Every ``health_check_interval_s`` each replica's
``GET /ready`` is read (``/health`` where ``/ready`` is a 404): one that is not ready is
skipped. ``ejection_failures`` consecutive failures of a request (a connection error, a 5xx
before the first token) eject a replica for ``ejection_backoff_s``, doubled per ejection in a
row up to ``ejection_backoff_max_s``. With every replica skipped, all are tried anyway.

Drain (``tollway serve``): on SIGTERM ``GET /ready`` answers 503 at once (``/health`` stays
200); the gateway keeps serving for ``drain_delay_s``, then stops accepting connections and
gives requests in flight up to ``drain_grace_s`` to finish; then it ends those still waiting on
an engine (a 503 ``server_shutting_down``, or a stream's error event), billed for what their
engines produced, and exits.

Connections (``tollway serve``, see ``gateway/launcher/bounded_http.py``): a request's headers
must arrive within ``header_timeout_s`` of its connection (or of its first byte on a kept-alive
one) and its body within ``body_timeout_s`` of its headers, both totals however the bytes
trickle in; late, the client gets a 408 ``request_timeout`` and the connection is closed. With
``max_connections`` connections open, or as many requests in flight, a further request gets a
503 ``service_unavailable`` with ``Retry-After``.

``GET /metrics`` needs ``Authorization: Bearer <token>``, since its labels name tenants'
models and traffic: the token is the metrics token (``metrics_token_hash``, for a Prometheus
``authorization:`` block) or the admin key. With neither configured it answers every scrape
with 401. There is no unauthenticated mode.

Redis and the database failing (see docs/operations.md): every Redis call is bounded by
``redis_timeout_s`` (0.5 s: a healthy Redis answers in well under a millisecond, so only a
stalled one takes that long, and a client waits at most that long to hear so), connecting by
``redis_connect_timeout_s`` (0.5 s). When Redis cannot answer, ``redis_failure_mode: closed``
(the default) answers 503 ``service_unavailable`` with ``Retry-After``: nothing is admitted that
was not counted. ``open`` admits requests without rate limits or budget reservations (counted
in ``tollway_gateway_uncounted_admissions_total``, logged once a second at most) and records
their usage as usual, so budgets may be overspent while Redis is down. When the database
cannot answer, a key verified less than ``auth_stale_ttl_s`` ago keeps working (``0``: never;
a key revoked through the admin API before the outage is still refused where Redis is up).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from gateway.alert_settings import AlertSettings, parse_alert_settings
from gateway.console_section import ConsoleSection, parse_console_section
from gateway.defaults import (
    DEFAULT_AUTH_UNKNOWN_KEY_TTL_S,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_DATA_DIR,
    DEFAULT_DNS_REFRESH_S,
    DEFAULT_DRAIN_DELAY_S,
    DEFAULT_DRAIN_GRACE_S,
    DEFAULT_EJECTION_BACKOFF_MAX_S,
    DEFAULT_EJECTION_BACKOFF_S,
    DEFAULT_EJECTION_FAILURES,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_HEALTH_CHECK_INTERVAL_S,
    DEFAULT_HOST,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_PORT,
    DEFAULT_REDIS_CONNECT_TIMEOUT_S,
    DEFAULT_REDIS_TIMEOUT_S,
    default_database_url,
)
from gateway.replica_settings import DNS_SCHEME, DnsUpstream, EjectionRule, ReplicaWatch
from gateway.rollouts import RolloutTable, check_rollouts, parse_rollouts, version_names
from policies.model_routing import ModelPair, RoutingPolicy
from policies.replica_choice import DEFAULT_REPLICA_POLICY, REPLICA_POLICIES, ReplicaPolicy
from policies.scoped_budgets import DEFAULT_CURRENCY, check_currency

_ENV_FIELDS: dict[str, str] = {
    "TOLLWAY_HOST": "host",
    "TOLLWAY_PORT": "port",
    "TOLLWAY_DATA_DIR": "data_dir",
    "TOLLWAY_DATABASE_URL": "database_url",
    "TOLLWAY_REDIS_URL": "redis_url",
    "TOLLWAY_ADMIN_KEY_HASH": "admin_key_hash",
    "TOLLWAY_METRICS_TOKEN_HASH": "metrics_token_hash",
    "TOLLWAY_RESERVATION_TTL_S": "reservation_ttl_s",
    "TOLLWAY_AUTH_CACHE_TTL_S": "auth_cache_ttl_s",
    "TOLLWAY_MAX_BODY_BYTES": "max_body_bytes",
    "TOLLWAY_OTEL_ENDPOINT": "otel_endpoint",
    "TOLLWAY_LOG_PROMPTS": "log_prompts",
    "TOLLWAY_REDIS_CONNECT_TIMEOUT_S": "redis_connect_timeout_s",
    "TOLLWAY_REDIS_TIMEOUT_S": "redis_timeout_s",
    "TOLLWAY_REDIS_FAILURE_MODE": "redis_failure_mode",
    "TOLLWAY_CURRENCY": "currency",
    "TOLLWAY_AUTH_STALE_TTL_S": "auth_stale_ttl_s",
    "TOLLWAY_AUTH_UNKNOWN_KEY_TTL_S": "auth_unknown_key_ttl_s",
    "TOLLWAY_DNS_REFRESH_S": "dns_refresh_s",
    "TOLLWAY_HEALTH_CHECK_INTERVAL_S": "health_check_interval_s",
    "TOLLWAY_EJECTION_FAILURES": "ejection_failures",
    "TOLLWAY_EJECTION_BACKOFF_S": "ejection_backoff_s",
    "TOLLWAY_EJECTION_BACKOFF_MAX_S": "ejection_backoff_max_s",
    "TOLLWAY_DRAIN_DELAY_S": "drain_delay_s",
    "TOLLWAY_HEADER_TIMEOUT_S": "header_timeout_s",
    "TOLLWAY_BODY_TIMEOUT_S": "body_timeout_s",
    "TOLLWAY_MAX_CONNECTIONS": "max_connections",
    "TOLLWAY_DRAIN_GRACE_S": "drain_grace_s",
}
_OPTIONAL_FIELDS = (
    "database_url",
    "redis_url",
    "admin_key_hash",
    "metrics_token_hash",
    "otel_endpoint",
)
REDIS_FAILURE_MODES = ("closed", "open")
_SECTIONS = ("models", "routing", "rollouts", "alerts", "console")
_TOP_LEVEL = {*_ENV_FIELDS.values(), *_SECTIONS}
_MODEL_FIELDS = {
    "upstreams", "context_window", "checkpoint", "prices", "upstream_model", "replica_policy",
}  # fmt: skip
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Prices:
    """Integer micro-units of currency per million tokens."""

    input: int = 0
    cached_input: int = 0
    output: int = 0

    def __post_init__(self) -> None:
        for name in ("input", "cached_input", "output"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"prices.{name} must be a non-negative integer, got {value!r}")

    def cost_micros(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """The price of one request, rounded up to a whole micro."""
        total = (
            (prompt_tokens - cached_tokens) * self.input
            + cached_tokens * self.cached_input
            + completion_tokens * self.output
        )
        return -(-total // 1_000_000)


@dataclass(frozen=True)
class ModelSettings:
    name: str
    upstreams: tuple[str, ...]
    context_window: int
    checkpoint: Path | None = None
    prices: Prices = field(default_factory=Prices)
    upstream_model: str | None = None  # the id the engines know it by; None: ``name``

    replica_policy: ReplicaPolicy = DEFAULT_REPLICA_POLICY

    def __post_init__(self) -> None:
        if self.replica_policy not in REPLICA_POLICIES:
            raise ValueError(
                f"model {self.name!r}: replica_policy must be one of "
                f"{', '.join(REPLICA_POLICIES)}, got {self.replica_policy!r}"
            )
        if self.upstream_model is not None and (
            not isinstance(self.upstream_model, str) or not self.upstream_model.strip()
        ):
            raise ValueError(
                f"model {self.name!r}: upstream_model must be the engine's model id (a "
                f"non-empty string), got {self.upstream_model!r}"
            )
        if not self.upstreams:
            raise ValueError(f"model {self.name!r} needs at least one upstream URL")
        for url in self.upstreams:
            if url.startswith(DNS_SCHEME):
                try:
                    DnsUpstream.parse(url)
                except ValueError as exc:
                    raise ValueError(f"model {self.name!r}: {exc}") from None
            elif not (url.startswith(("http://", "https://")) or _is_unix(url)):
                raise ValueError(
                    f"model {self.name!r}: upstream {url!r} must be http://host:port, "
                    "unix:/path/to/engine.sock or dns://host:port"
                )
        if isinstance(self.context_window, bool) or not isinstance(self.context_window, int):
            raise ValueError(f"model {self.name!r}: context_window must be an integer")
        if self.context_window < 2:
            raise ValueError(f"model {self.name!r}: context_window must be at least 2")

    @property
    def upstream_id(self) -> str:
        """What the gateway sends upstream as the body's ``model``."""
        return self.upstream_model or self.name


@dataclass(frozen=True)
class GatewaySettings:
    models: Mapping[str, ModelSettings]
    routing: RoutingPolicy | None = None
    rollouts: RolloutTable = field(default_factory=dict)  # the start-up table (see LiveRollouts)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    data_dir: Path = DEFAULT_DATA_DIR
    database_url: str | None = None
    redis_url: str | None = None
    admin_key_hash: str | None = None
    metrics_token_hash: str | None = None
    reservation_ttl_s: float = 600.0
    # Keys revoked and quotas changed through the admin API apply at once on every replica
    # (see `gateway.auth.epochs`); this bounds how long a change made around it may go unseen.
    auth_cache_ttl_s: float = 10.0
    auth_stale_ttl_s: float = 600.0
    # A key created through the admin API works at once (the key set's auth epoch); this bounds
    # how long the filter of known keys may refuse one written straight in the database or
    # created while Redis is down (see `gateway.auth.known_key_filter`); 0: no filter.
    auth_unknown_key_ttl_s: float = DEFAULT_AUTH_UNKNOWN_KEY_TTL_S
    redis_connect_timeout_s: float = DEFAULT_REDIS_CONNECT_TIMEOUT_S
    redis_timeout_s: float = DEFAULT_REDIS_TIMEOUT_S
    redis_failure_mode: str = "closed"
    max_body_bytes: int = 1 << 20
    otel_endpoint: str | None = None
    log_prompts: bool = False
    dns_refresh_s: float = DEFAULT_DNS_REFRESH_S
    health_check_interval_s: float = DEFAULT_HEALTH_CHECK_INTERVAL_S
    ejection_failures: int = DEFAULT_EJECTION_FAILURES
    ejection_backoff_s: float = DEFAULT_EJECTION_BACKOFF_S
    ejection_backoff_max_s: float = DEFAULT_EJECTION_BACKOFF_MAX_S
    drain_delay_s: float = DEFAULT_DRAIN_DELAY_S
    drain_grace_s: float = DEFAULT_DRAIN_GRACE_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # The currency ``prices`` and money budgets are in: how money is named wherever it is shown.
    currency: str = DEFAULT_CURRENCY
    alerts: AlertSettings | None = None  # None: no budget alerts
    console: ConsoleSection = field(default_factory=ConsoleSection)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("configure at least one model under `models:`")
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))
        object.__setattr__(self, "rollouts", MappingProxyType(dict(self.rollouts)))
        aliases = self.routing.aliases if self.routing is not None else {}
        check_rollouts(self.rollouts, self.models, aliases)
        for alias, pair in aliases.items():
            if alias in self.models:
                raise ValueError(f"routing alias {alias!r} shadows a model of that name")
            for target in (pair.small, pair.large):
                if target not in self.models and target not in self.rollouts:
                    raise ValueError(
                        f"routing alias {alias!r} names {target!r}, which is neither under "
                        f"`models:` (known: {', '.join(sorted(self.models))}) nor under "
                        "`rollouts:`"
                    )
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not self.reservation_ttl_s > 0:
            raise ValueError(f"reservation_ttl_s must be > 0, got {self.reservation_ttl_s}")
        if not self.auth_cache_ttl_s >= 0:
            raise ValueError(
                f"auth_cache_ttl_s must be >= 0 (0 reads every key from the database), "
                f"got {self.auth_cache_ttl_s}"
            )
        if not self.auth_stale_ttl_s >= 0:
            raise ValueError(
                f"auth_stale_ttl_s must be >= 0 (0: no key works while the database is "
                f"unreachable), got {self.auth_stale_ttl_s}"
            )
        if not self.auth_unknown_key_ttl_s >= 0:
            raise ValueError(
                f"auth_unknown_key_ttl_s must be >= 0 (0 reads every unknown key from the "
                f"database), got {self.auth_unknown_key_ttl_s}"
            )
        for name in ("redis_connect_timeout_s", "redis_timeout_s"):
            value = getattr(self, name)
            if not 0 < value <= 60:
                raise ValueError(f"{name} must be in (0, 60] seconds, got {value}")
        check_currency(self.currency)
        if self.redis_failure_mode not in REDIS_FAILURE_MODES:
            raise ValueError(
                f"redis_failure_mode must be closed (answer 503 while Redis is down) or open "
                f"(admit without rate limits and budgets), got {self.redis_failure_mode!r}"
            )
        self.replica_watch  # noqa: B018 (validates the replica settings)
        for name in ("drain_delay_s", "drain_grace_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        for name in ("admin_key_hash", "metrics_token_hash"):
            value = getattr(self, name)
            if value is not None and not _SHA256_HEX.fullmatch(value):
                raise ValueError(
                    f"{name} must be 64 lowercase hex characters: "
                    "python -c 'import hashlib;print(hashlib.sha256(b\"KEY\").hexdigest())'"
                )

    @property
    def replica_watch(self) -> ReplicaWatch:
        """How engine replicas are found, checked and ejected."""
        return ReplicaWatch(
            dns_refresh_s=self.dns_refresh_s,
            health_check_interval_s=self.health_check_interval_s,
            ejection=EjectionRule(
                failures_to_eject=self.ejection_failures,
                backoff_s=self.ejection_backoff_s,
                backoff_max_s=self.ejection_backoff_max_s,
            ),
        )

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or default_database_url(self.data_dir)

    @property
    def known_models(self) -> frozenset[str]:
        """Every name a client may send: served models (versions too), rollouts and routing
        aliases. Fixed at start-up (a reload changes a rollout's versions, not its name)."""
        aliases = self.routing.aliases if self.routing is not None else {}
        return frozenset(self.models) | frozenset(self.rollouts) | frozenset(aliases)

    def public_models(self, rollouts: RolloutTable) -> frozenset[str]:
        """The names ``/v1/models`` lists: `known_models` but the versions of ``rollouts``."""
        return self.known_models - version_names(rollouts)

    @classmethod
    def from_yaml(cls, path: str | Path, env: Mapping[str, str] = os.environ) -> GatewaySettings:
        text = Path(path).read_text(encoding="utf-8")
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        return cls.from_dict(data, env=env, base_dir=Path(path).parent)

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], env: Mapping[str, str] = {}, base_dir: Path = Path(".")
    ) -> GatewaySettings:
        unknown = sorted(set(data) - _TOP_LEVEL)
        if unknown:
            raise ValueError(
                f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(_TOP_LEVEL))}"
            )
        values: dict[str, Any] = {k: v for k, v in data.items() if k not in _SECTIONS}
        for var, name in _ENV_FIELDS.items():
            if var in env:
                values[name] = env[var] if env[var] != "" else None
        kwargs = _convert_scalars(values, base_dir)
        models = _models(data.get("models"), base_dir)
        routing = _routing(data.get("routing"))
        rollouts = parse_rollouts(data.get("rollouts"))
        alerts = parse_alert_settings(data.get("alerts"), env)
        console = parse_console_section(data.get("console"), env)
        return cls(
            models=models,
            routing=routing,
            rollouts=rollouts,
            alerts=alerts,
            console=console,
            **kwargs,
        )


def _is_unix(url: str) -> bool:
    return url.startswith("unix:") and len(url) > len("unix:")


def _convert_scalars(values: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            if name in _OPTIONAL_FIELDS:
                out[name] = None
            continue
        try:
            if name in ("port", "max_body_bytes", "ejection_failures", "max_connections"):
                out[name] = int(value)
            elif name in (
                "reservation_ttl_s",
                "auth_cache_ttl_s",
                "auth_stale_ttl_s",
                "auth_unknown_key_ttl_s",
                "redis_connect_timeout_s",
                "redis_timeout_s",
                "dns_refresh_s",
                "health_check_interval_s",
                "ejection_backoff_s",
                "ejection_backoff_max_s",
                "drain_delay_s",
                "drain_grace_s",
                "header_timeout_s",
                "body_timeout_s",
            ):
                out[name] = float(value)
            elif name == "log_prompts":
                out[name] = _bool(value)
            elif name == "data_dir":
                out[name] = base_dir / Path(str(value))
            else:
                out[name] = str(value)
        except (TypeError, ValueError):
            raise ValueError(f"setting {name}: cannot use {value!r}") from None
    return out


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _models(raw: Any, base_dir: Path) -> dict[str, ModelSettings]:
    if not isinstance(raw, dict) or not raw:
        raise ValueError("`models:` must map each model name to {upstreams, context_window, ...}")
    models: dict[str, ModelSettings] = {}
    for name, spec in raw.items():
        if not isinstance(spec, dict):
            raise ValueError(f"model {name!r}: expected a mapping")
        extra = sorted(set(spec) - _MODEL_FIELDS)
        if extra:
            raise ValueError(f"model {name!r}: unknown field(s) {', '.join(extra)}")
        upstreams = spec.get("upstreams")
        if isinstance(upstreams, str):
            upstreams = [upstreams]
        if not isinstance(upstreams, list):
            raise ValueError(f"model {name!r}: upstreams must be a list of URLs")
        if "context_window" not in spec:
            raise ValueError(
                f"model {name!r}: context_window is required: the most tokens its engine "
                "holds for one request, prompt and completion together (its max model "
                "length, e.g. 8192)"
            )
        checkpoint = spec.get("checkpoint")
        prices = spec.get("prices") or {}
        if not isinstance(prices, dict):
            raise ValueError(f"model {name!r}: prices must map input/cached_input/output")
        try:
            price = Prices(**prices)
        except TypeError:
            raise ValueError(
                f"model {name!r}: prices take input, cached_input and output, got {sorted(prices)}"
            ) from None
        models[str(name)] = ModelSettings(
            name=str(name),
            upstreams=tuple(str(u) for u in upstreams),
            context_window=spec["context_window"],
            checkpoint=base_dir / Path(str(checkpoint)) if checkpoint else None,
            prices=price,
            upstream_model=spec.get("upstream_model"),
            replica_policy=spec.get("replica_policy", DEFAULT_REPLICA_POLICY),
        )
    return models


def _routing(raw: Any) -> RoutingPolicy | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("`routing:` must be a mapping with `aliases:`")
    spec = dict(raw)
    aliases = spec.pop("aliases", None)
    if not isinstance(aliases, dict) or not aliases:
        raise ValueError("routing.aliases must map an alias to {small: MODEL, large: MODEL}")
    pairs: dict[str, ModelPair] = {}
    for alias, pair in aliases.items():
        if not isinstance(pair, dict) or set(pair) != {"small", "large"}:
            raise ValueError(f"routing alias {alias!r} needs exactly `small:` and `large:`")
        pairs[str(alias)] = ModelPair(small=str(pair["small"]), large=str(pair["large"]))
    if "large_tiers" in spec:
        spec["large_tiers"] = frozenset(spec["large_tiers"] or ())
    try:
        return RoutingPolicy(aliases=pairs, **spec)
    except TypeError as exc:
        raise ValueError(f"routing: {exc}") from None
