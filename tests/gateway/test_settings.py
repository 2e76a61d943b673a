"""Gateway settings: YAML, environment overrides, and actionable validation errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import GatewaySettings, Prices

YAML = """
port: 9000
redis_url: redis://localhost:6379/0
models:
  small:
    upstreams: [unix:/run/small.sock]
    context_window: 4096
    prices: {input: 100, output: 300}
  large:
    upstreams: http://10.0.0.2:8100
    context_window: 8192
routing:
  aliases: {auto: {small: small, large: large}}
  long_prompt_tokens: 1000
  large_tiers: [gold]
"""


def test_from_yaml_with_env_overrides(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(YAML)
    env = {"TOLLWAY_PORT": "9100", "TOLLWAY_REDIS_URL": "", "TOLLWAY_LOG_PROMPTS": "true"}
    settings = GatewaySettings.from_yaml(path, env=env)
    assert settings.port == 9100
    assert settings.redis_url is None
    assert settings.log_prompts
    assert settings.models["large"].upstreams == ("http://10.0.0.2:8100",)
    assert settings.known_models == {"small", "large", "auto"}
    assert settings.routing is not None
    assert settings.routing.large_tiers == {"gold"}
    assert settings.resolved_database_url.startswith("sqlite:///")


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"models": {"m": {"upstreams": ["ftp://x"], "context_window": 10}}}, "unix:/path"),
        ({"models": {"m": {"upstreams": ["http://x"]}}}, "context_window is required"),
        ({"models": {"m": {"upstreams": ["http://x"], "context_window": 1}}}, "at least 2"),
        ({"routing": {"aliases": {"auto": {"small": "m", "large": "nope"}}}}, "nope"),
        ({"reservation_ttl_s": 0}, "reservation_ttl_s"),
        ({"admin_key_hash": "secret"}, "sha256"),
        ({"colour": "blue"}, "unknown setting"),
        ({"redis_timeout_s": 0}, "redis_timeout_s must be in"),
        ({"redis_connect_timeout_s": 61}, "redis_connect_timeout_s must be in"),
        ({"redis_failure_mode": "ajar"}, "redis_failure_mode must be closed"),
        ({"auth_stale_ttl_s": -1}, "auth_stale_ttl_s must be >= 0"),
        ({"models": {"m": {"upstreams": ["dns://x"], "context_window": 10}}}, "dns://host:port"),
        ({"dns_refresh_s": 0}, "dns_refresh_s must be > 0"),
        ({"health_check_interval_s": -1}, "health_check_interval_s must be >= 0"),
        ({"ejection_failures": 0}, "ejection_failures must be"),
        ({"ejection_backoff_s": 5, "ejection_backoff_max_s": 1}, "ejection_backoff_max_s"),
        ({"drain_grace_s": -1}, "drain_grace_s must be >= 0"),
        ({"header_timeout_s": 0}, "header_timeout_s must be > 0"),
        ({"body_timeout_s": -1}, "body_timeout_s must be > 0"),
        ({"max_connections": 0}, "max_connections must be at least 1"),
        ({"currency": "usd"}, "currency must be a three-letter uppercase currency code"),
        ({"currency": "EURO"}, "currency must be a three-letter uppercase currency code"),
        (
            {
                "models": {
                    "m": {"upstreams": ["http://x"], "context_window": 9, "replica_policy": 1}
                }
            },
            "replica_policy must be one of prefix, least_loaded, round_robin, got 1",
        ),
    ],
)
def test_validation_says_what_to_fix(patch: dict[str, object], message: str) -> None:
    data: dict[str, object] = {"models": {"m": {"upstreams": ["http://x"], "context_window": 64}}}
    data.update(patch)
    with pytest.raises(ValueError, match=message):
        GatewaySettings.from_dict(data)


def test_replica_policy_is_per_model_with_prefix_the_default() -> None:
    models = {
        "a": {"upstreams": ["http://x"], "context_window": 64},
        "b": {"upstreams": ["http://y"], "context_window": 64, "replica_policy": "round_robin"},
    }
    settings = GatewaySettings.from_dict({"models": models})
    assert settings.models["a"].replica_policy == "prefix"
    assert settings.models["b"].replica_policy == "round_robin"


def test_a_missing_context_window_is_named_required_and_explained() -> None:
    data: dict[str, object] = {"models": {"m": {"upstreams": ["http://x"]}}}
    with pytest.raises(ValueError, match="context_window is required") as raised:
        GatewaySettings.from_dict(data)
    message = str(raised.value)
    assert message.startswith("model 'm': context_window is required: ")
    assert "prompt and completion together" in message
    assert "must be at least 2" not in message


def test_cost_is_integer_micros_rounded_up() -> None:
    prices = Prices(input=1_000_000, cached_input=500_000, output=3)
    assert prices.cost_micros(prompt_tokens=10, cached_tokens=4, completion_tokens=1) == 6 + 2 + 1


def test_outage_settings_have_documented_defaults_and_env_overrides() -> None:
    data: dict[str, object] = {"models": {"m": {"upstreams": ["http://x"], "context_window": 64}}}
    defaults = GatewaySettings.from_dict(data)
    assert (defaults.redis_connect_timeout_s, defaults.redis_timeout_s) == (0.5, 0.5)
    assert (defaults.redis_failure_mode, defaults.auth_stale_ttl_s) == ("closed", 600.0)
    env = {
        "TOLLWAY_REDIS_CONNECT_TIMEOUT_S": "0.2",
        "TOLLWAY_REDIS_TIMEOUT_S": "1",
        "TOLLWAY_REDIS_FAILURE_MODE": "open",
        "TOLLWAY_AUTH_STALE_TTL_S": "0",
    }
    settings = GatewaySettings.from_dict(data, env=env)
    assert (settings.redis_connect_timeout_s, settings.redis_timeout_s) == (0.2, 1.0)
    assert (settings.redis_failure_mode, settings.auth_stale_ttl_s) == ("open", 0.0)


def test_replica_and_drain_settings_have_documented_defaults_and_env_overrides() -> None:
    upstreams = ["unix:/run/a.sock", "http://10.0.0.2:8100", "dns://engine-small:8100"]
    data: dict[str, object] = {"models": {"m": {"upstreams": upstreams, "context_window": 64}}}
    defaults = GatewaySettings.from_dict(data)
    assert defaults.models["m"].upstreams == tuple(upstreams)
    watch = defaults.replica_watch
    assert (watch.dns_refresh_s, watch.health_check_interval_s) == (5.0, 5.0)
    assert (watch.ejection.failures_to_eject, watch.ejection.backoff_s) == (3, 1.0)
    assert watch.ejection.backoff_max_s == 30.0
    assert (defaults.drain_delay_s, defaults.drain_grace_s) == (5.0, 30.0)
    env = {
        "TOLLWAY_DNS_REFRESH_S": "1",
        "TOLLWAY_HEALTH_CHECK_INTERVAL_S": "0",
        "TOLLWAY_EJECTION_FAILURES": "5",
        "TOLLWAY_EJECTION_BACKOFF_S": "2",
        "TOLLWAY_EJECTION_BACKOFF_MAX_S": "60",
        "TOLLWAY_DRAIN_DELAY_S": "2",
        "TOLLWAY_DRAIN_GRACE_S": "45",
    }
    settings = GatewaySettings.from_dict(data, env=env)
    watch = settings.replica_watch
    assert (watch.dns_refresh_s, watch.health_check_interval_s) == (1.0, 0.0)
    assert (watch.ejection.failures_to_eject, watch.ejection.backoff_s) == (5, 2.0)
    assert watch.ejection.backoff_max_s == 60.0
    assert (settings.drain_delay_s, settings.drain_grace_s) == (2.0, 45.0)


def test_connection_limits_have_documented_defaults_and_env_overrides() -> None:
    data: dict[str, object] = {"models": {"m": {"upstreams": ["http://x"], "context_window": 64}}}
    defaults = GatewaySettings.from_dict(data)
    assert (defaults.header_timeout_s, defaults.body_timeout_s) == (10.0, 30.0)
    assert defaults.max_connections == 1000
    env = {
        "TOLLWAY_HEADER_TIMEOUT_S": "2",
        "TOLLWAY_BODY_TIMEOUT_S": "7.5",
        "TOLLWAY_MAX_CONNECTIONS": "64",
    }
    settings = GatewaySettings.from_dict(data, env=env)
    assert (settings.header_timeout_s, settings.body_timeout_s) == (2.0, 7.5)
    assert settings.max_connections == 64


def test_currency_defaults_to_usd_and_is_set_at_the_top_level_or_by_the_environment() -> None:
    data: dict[str, object] = {"models": {"m": {"upstreams": ["http://x"], "context_window": 64}}}
    assert GatewaySettings.from_dict(data).currency == "USD"
    assert GatewaySettings.from_dict({**data, "currency": "EUR"}).currency == "EUR"
    from_env = GatewaySettings.from_dict(data, env={"TOLLWAY_CURRENCY": "CHF"})
    assert from_env.currency == "CHF"
