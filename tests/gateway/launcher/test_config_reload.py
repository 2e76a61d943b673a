"""Rollout weights change without a restart: the reloader on its own, then a real
``tollway serve --config`` whose file is edited while it serves."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.api.completions import VERSION_HEADER
from gateway.launcher.config_reload import RolloutReloader, audit_rollouts, watching_rollouts
from gateway.rollouts import LiveRollouts, parse_rollouts, resolve_version
from gateway.settings import GatewaySettings
from gateway.storage import migrate
from gateway.storage.api_keys import hash_key
from gateway.storage.audit_log import audit_page
from gateway.storage.database import Database
from tests.support.polling import wait_until
from tests.support.stand_in_stack import stand_in_engine, tenant_key

REPO_ROOT = Path(__file__).resolve().parents[3]
ADMIN_KEY = "admin-" + "c" * 40


def config(upstreams: dict[str, str], weights: dict[str, int], **extra: Any) -> dict[str, Any]:
    models = {name: {"upstreams": [url], "context_window": 4096} for name, url in upstreams.items()}
    return {"models": models, "rollouts": {"large": weights}, **extra}


def write(path: Path, data: dict[str, Any] | str) -> None:
    """Replace the file whole, as a ConfigMap update does (a new file, renamed over)."""
    text = data if isinstance(data, str) else yaml.safe_dump(data)
    partial = path.with_suffix(".tmp")
    partial.write_text(text)
    os.replace(partial, path)


UPSTREAMS = {"large-v1": "unix:/run/v1.sock", "large-v2": "unix:/run/v2.sock"}


@pytest.fixture
def reloader(tmp_path: Path) -> Iterator[tuple[Path, LiveRollouts, RolloutReloader]]:
    path = tmp_path / "tollway.yaml"
    write(path, config(UPSTREAMS, {"large-v1": 95, "large-v2": 5}))
    settings = GatewaySettings.from_yaml(path)
    live = LiveRollouts(settings.rollouts)
    return path, live, RolloutReloader(path, live, settings)


def weights(live: LiveRollouts) -> dict[str, int]:
    return dict(live.table["large"].weights)


def test_changed_weights_are_applied_whole(reloader, caplog: pytest.LogCaptureFixture) -> None:
    path, live, watcher = reloader
    assert not watcher.check()  # unchanged
    write(path, config(UPSTREAMS, {"large-v1": 90, "large-v2": 10}))
    with caplog.at_level(logging.WARNING):
        assert watcher.check()
    assert weights(live) == {"large-v1": 90, "large-v2": 10}
    assert "rollouts now large: large-v1 90, large-v2 10" in caplog.text
    assert "restart" not in caplog.text


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("models: [unclosed", "while parsing"),
        ("- a list", "expected a mapping at the top level"),
        (
            yaml.safe_dump(config(UPSTREAMS, {"large-v1": 90, "large-v3": 10})),
            "names version 'large-v3', which is not under `models:`",
        ),
        (yaml.safe_dump(config(UPSTREAMS, {"large-v1": 0})), "must be a positive integer"),
        (
            yaml.safe_dump({**config(UPSTREAMS, {"large-v1": 1}), "rollouts": {}}),
            "adding or removing a rollout needs a restart",
        ),
    ],
)
def test_a_bad_file_keeps_the_table_in_force_and_says_why(
    reloader, caplog: pytest.LogCaptureFixture, text: str, reason: str
) -> None:
    path, live, watcher = reloader
    write(path, text)
    with caplog.at_level(logging.WARNING):
        assert not watcher.check()
    assert weights(live) == {"large-v1": 95, "large-v2": 5}
    assert reason in caplog.text
    assert "the rollouts in force stay (large: large-v1 95, large-v2 5)" in caplog.text
    write(path, config(UPSTREAMS, {"large-v1": 50, "large-v2": 50}))  # fixed: applied
    assert watcher.check()
    assert weights(live) == {"large-v1": 50, "large-v2": 50}


def test_other_changes_are_logged_as_needing_a_restart(
    reloader, caplog: pytest.LogCaptureFixture
) -> None:
    path, live, watcher = reloader
    changed = config(UPSTREAMS, {"large-v1": 80, "large-v2": 20}, port=9999)
    changed["models"]["large-v2"]["context_window"] = 8192
    write(path, changed)
    with caplog.at_level(logging.WARNING):
        assert watcher.check()
    assert "changes to models, port need a restart and were not applied" in caplog.text
    assert weights(live) == {"large-v1": 80, "large-v2": 20}  # the rollouts still apply


def test_the_watch_thread_applies_an_edit_and_stops(reloader) -> None:
    path, live, _ = reloader
    settings = GatewaySettings.from_yaml(path)
    with watching_rollouts(path, live, settings, interval_s=0.01) as watcher:
        write(path, config(UPSTREAMS, {"large-v1": 1, "large-v2": 1}))
        wait_until(lambda: weights(live) == {"large-v1": 1, "large-v2": 1}, what="the reload")
    assert not any(t.name == "tollway-config-reload" for t in threading.enumerate())
    assert isinstance(watcher, RolloutReloader)


@pytest.mark.e2e
def test_a_serving_gateway_moves_traffic_when_its_config_changes(tmp_path: Path) -> None:
    """``tollway serve --config``: start on large-v1 alone, edit the file to 50/50, then to a
    bad table; each user is served by the version the file in force chooses."""
    database_url = f"sqlite:///{tmp_path / 'tollway.db'}"
    migrate.upgrade(database_url)
    tenant_id, key = tenant_key(database_url)
    path = tmp_path / "tollway.yaml"
    port = _free_port()
    with ExitStack() as stack:
        engines = {v: stack.enter_context(stand_in_engine()) for v in ("large-v1", "large-v2")}
        upstreams = {name: engine.upstream for name, engine in engines.items()}
        base = {
            "database_url": database_url,
            "admin_key_hash": hash_key(ADMIN_KEY),
            "data_dir": str(tmp_path / "data"),
            "port": port,
            "drain_delay_s": 0,  # its stop (SIGTERM) need not wait for load balancers
        }
        write(path, config(upstreams, {"large-v1": 1}, **base))
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.launcher.serve_cli", "--config", str(path)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")))
        reader.start()
        try:
            wait_until(lambda: _answers(port), timeout_s=60, what="".join(lines))
            users = [f"user-{n}" for n in range(16)]

            def served() -> dict[str, str]:
                return {user: _version(port, key, user) for user in users}

            assert set(served().values()) == {"large-v1"}

            half = config(upstreams, {"large-v1": 1, "large-v2": 1}, **base)
            write(path, half)
            expected = {
                u: resolve_version(parse_rollouts(half["rollouts"]), "large", tenant_id, u)
                for u in users
            }
            assert set(expected.values()) == {"large-v1", "large-v2"}
            wait_until(lambda: served() == expected, timeout_s=20, what="the 50/50 table")
            wait_until(lambda: any("rollouts now large" in line for line in lines))

            write(path, config(upstreams, {"large-v1": 1, "large-v3": 1}, **base))
            wait_until(
                lambda: any("large-v3" in line and "stay" in line for line in lines),
                timeout_s=20,
                what="the bad file is logged",
            )
            assert served() == expected  # the old table still serves
            assert process.poll() is None
        finally:
            process.terminate()
            process.wait(timeout=30)
            reader.join(timeout=5)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _version(port: int, key: str, user: str) -> str:
    response = httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": "large", "user": user, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "large"
    return response.headers[VERSION_HEADER]


def test_applied_weights_are_written_to_the_audit_log(tmp_path: Path, db: Database) -> None:
    path = tmp_path / "tollway.yaml"
    write(path, config(UPSTREAMS, {"large-v1": 95, "large-v2": 5}))
    settings = GatewaySettings.from_yaml(path)
    live = LiveRollouts(settings.rollouts)
    watcher = RolloutReloader(path, live, settings, audit_rollouts(db, path))
    write(path, config(UPSTREAMS, {"large-v1": 50, "large-v2": 50}))
    assert watcher.check()
    write(path, config(UPSTREAMS, {"large-v1": 50, "large-v3": 1}))  # refused: not applied
    assert not watcher.check()
    with db.session() as session:
        page = audit_page(session, tenant_id=None, start=None, end=None, cursor=None, limit=10)
    [entry] = page.records
    assert (entry.action, entry.actor) == ("rollout.weights_changed", "config-file:tollway.yaml")
    assert (entry.target_type, entry.target_id, entry.tenant_id) == ("rollout", "large", None)
    assert entry.before == {"weights": {"large-v1": 95, "large-v2": 5}}
    assert entry.after == {"weights": {"large-v1": 50, "large-v2": 50}}
