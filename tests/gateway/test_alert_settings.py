import pytest

from gateway.alert_settings import AlertSettings, parse_alert_settings
from gateway.settings import GatewaySettings

SECRET = "whsec_c2VjcmV0LXNlY3JldC1zZWNyZXQ="
MODELS = {"small": {"upstreams": ["http://127.0.0.1:9"], "context_window": 2048}}


def test_no_alerts_section_means_no_alerts():
    assert parse_alert_settings(None, {}) is None
    assert GatewaySettings.from_dict({"models": MODELS}).alerts is None


def test_settings_read_the_section_and_the_environment():
    raw = {"webhook_url": "https://hooks.example.com/t", "thresholds": [100, 50]}
    env = {"TOLLWAY_ALERT_WEBHOOK_SECRET": SECRET}
    settings = GatewaySettings.from_dict({"models": MODELS, "alerts": raw}, env=env)
    assert settings.alerts == AlertSettings(
        "https://hooks.example.com/t", SECRET, thresholds=(50, 100)
    )
    only_env = {**env, "TOLLWAY_ALERT_WEBHOOK_URL": "http://127.0.0.1:1/hook"}
    alerts = parse_alert_settings(None, only_env)
    assert alerts is not None
    assert alerts.webhook_url == "http://127.0.0.1:1/hook"


def test_the_secret_never_shows_in_repr():
    alerts = AlertSettings("https://h.example/x", SECRET)
    assert SECRET not in repr(alerts)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"webhook_url": "ftp://x", "webhook_secret": SECRET}, "http:// or https://"),
        ({"webhook_url": "https://x"}, "at least 16 characters"),
        ({"webhook_secret": SECRET}, "webhook_url is required"),
        ({"webhook_url": "https://x", "webhook_secret": SECRET, "thresholds": [0]}, "percents"),
        ({"webhook_url": "https://x", "webhook_secret": SECRET, "retries": 3}, "unknown"),
        ({"webhook_url": "https://x", "webhook_secret": SECRET, "timeout_s": "soon"}, "timeout_s"),
        (
            {
                "webhook_url": "https://x",
                "webhook_secret": SECRET,
                "retry_first_delay_s": 10,
                "retry_max_delay_s": 1,
            },
            "retry_first_delay_s <= retry_max_delay_s",
        ),
    ],
)
def test_bad_settings_say_what_is_wrong(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_alert_settings(raw, {})


def test_retry_delays_double_up_to_the_cap():
    alerts = AlertSettings(
        "https://h.example/x", SECRET, retry_first_delay_s=1, retry_max_delay_s=5
    )
    assert [alerts.retry_delay_s(n) for n in range(1, 6)] == [1, 2, 4, 5, 5]
    assert alerts.retry_delay_s(10_000) == 5
