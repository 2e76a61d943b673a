"""The ``console:`` settings: the session secret from the file or the environment, never
shown, checked for length with a message saying how to make one."""

from __future__ import annotations

import logging

import pytest

from gateway.app import console_settings
from gateway.console_section import ConsoleSection, parse_console_section
from gateway.settings import GatewaySettings

SECRET = "k" * 43
MODELS = {"small": {"upstreams": ["http://127.0.0.1:9"], "context_window": 2048}}


def test_no_section_means_a_secret_per_process(caplog: pytest.LogCaptureFixture) -> None:
    section = GatewaySettings.from_dict({"models": MODELS}).console
    assert section == ConsoleSection(session_secret=None)
    with caplog.at_level(logging.WARNING, logger="gateway.app"):
        first, second = console_settings(section), console_settings(section)
    assert first.session_secret != second.session_secret
    assert len(first.session_secret) == 32
    assert "valid only on this gateway replica" in caplog.text


def test_the_secret_comes_from_the_file_or_the_environment_which_wins() -> None:
    from_file = GatewaySettings.from_dict({"models": MODELS, "console": {"session_secret": SECRET}})
    assert from_file.console.session_secret == SECRET
    assert console_settings(from_file.console).session_secret == SECRET.encode()
    env = {"TOLLWAY_CONSOLE_SESSION_SECRET": "e" * 32}
    assert parse_console_section({"session_secret": SECRET}, env).session_secret == "e" * 32
    assert parse_console_section(None, env).session_secret == "e" * 32
    empty = {"TOLLWAY_CONSOLE_SESSION_SECRET": ""}
    assert parse_console_section({"session_secret": SECRET}, empty).session_secret == SECRET


def test_the_secret_never_shows_in_repr() -> None:
    settings = GatewaySettings.from_dict({"models": MODELS, "console": {"session_secret": SECRET}})
    assert SECRET not in repr(settings.console)
    assert SECRET not in repr(settings)
    assert SECRET.encode() not in repr(console_settings(settings.console)).encode()


@pytest.mark.parametrize(
    ("raw", "env", "message"),
    [
        ({"session_secret": "short"}, {}, "at least 32 characters, got 5"),
        (None, {"TOLLWAY_CONSOLE_SESSION_SECRET": "x" * 31}, "secrets.token_urlsafe(32)"),
        ({"session_secret": 12345678}, {}, "must be a string"),
        ({"secret": SECRET}, {}, "unknown field(s) secret; known: session_secret"),
        ([SECRET], {}, "must be a mapping"),
    ],
)
def test_bad_values_say_what_to_do(raw: object, env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match="console") as raised:
        GatewaySettings.from_dict({"models": MODELS, "console": raw}, env=env)
    assert message in str(raised.value)
    assert "x" * 31 not in str(raised.value)
