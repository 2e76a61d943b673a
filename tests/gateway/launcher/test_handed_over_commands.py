"""The engine's commands in a gateway-only install (no torch): one line saying how to add
the engine, exit 1, and nothing started; with the engine installed, the engine's own command
runs. `tollway serve` refuses before anything starts only when its plan spawns engines."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from backend_engine.config import EngineConfig
from gateway.launcher.cli import app
from gateway.launcher.engine_install import ENGINE_INSTALL_COMMAND, is_engine_installed
from tests.support.gguf_files import hf_tensors, write_gguf
from tests.support.without_engine import run_tollway_without_engine, run_without_engine


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory: Unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="tw-cmd-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _assert_says_how_to_add_the_engine(stderr: str, what: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr  # one line, no traceback
    assert lines[0].startswith("error: ")
    assert what in lines[0]
    assert lines[0].endswith(ENGINE_INSTALL_COMMAND)


@pytest.mark.parametrize(
    "args",
    [
        ["engine", "--model", "m.gguf"],
        ["engine", "--help"],
        ["demo-model", "out"],
        ["convert", "m.gguf", "out"],
    ],
)
def test_an_engine_command_without_the_engine_says_how_to_add_it(
    args: list[str], tmp_path: Path
) -> None:
    result = run_tollway_without_engine(*args, cwd=tmp_path)
    assert result.returncode == 1
    _assert_says_how_to_add_the_engine(result.stderr, f"`tollway {args[0]}`")
    assert list(tmp_path.iterdir()) == []


def test_serve_that_spawns_engines_refuses_before_starting_anything(short_tmp: Path) -> None:
    write_gguf(short_tmp / "m.gguf", hf_tensors(), tokenizer_pre="smollm")
    config = short_tmp / "tollway.yaml"
    config.write_text("models:\n  small:\n    spawn: {checkpoint: m.gguf}\n")
    data = short_tmp / "data"
    result = run_tollway_without_engine("serve", "--config", str(config), "--data-dir", str(data))
    assert result.returncode == 1
    _assert_says_how_to_add_the_engine(result.stderr, "spawning engines (small)")
    assert not data.exists()


def test_the_embedded_default_without_the_engine_refuses_before_starting_anything(
    short_tmp: Path,
) -> None:
    data = short_tmp / "data"
    result = run_tollway_without_engine("serve", "--data-dir", str(data), "--demo-models")
    assert result.returncode == 1
    _assert_says_how_to_add_the_engine(result.stderr, "`tollway serve` without --config")
    assert not data.exists()


def test_serve_with_only_remote_upstreams_prepares_without_the_engine(short_tmp: Path) -> None:
    config = short_tmp / "tollway.yaml"
    config.write_text(
        "models:\n  remote:\n    upstreams: [http://127.0.0.1:9]\n    context_window: 4096\n"
    )
    result = run_without_engine(
        "import sys\n"
        "from pathlib import Path\n"
        "from gateway.launcher.serve import ServeOptions, prepare\n"
        "plan, credentials = prepare(\n"
        "    ServeOptions(config=Path(sys.argv[1]), data_dir=Path(sys.argv[2])), say=print\n"
        ")\n"
        "print(len(plan.engines), sorted(plan.settings.known_models), credentials.is_new)\n",
        str(config),
        str(short_tmp / "data"),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "0 ['remote'] True"


def test_writing_demo_models_without_the_engine_says_how_to_add_it(short_tmp: Path) -> None:
    (short_tmp / "models" / "small").mkdir(parents=True)
    (short_tmp / "models" / "small" / "config.json").write_text("{}")
    result = run_without_engine(
        "import sys\n"
        "from pathlib import Path\n"
        "from gateway.launcher.data_dir_setup import ensure_demo_checkpoints\n"
        "from gateway.launcher.engine_install import EngineNotInstalledError\n"
        "models = Path(sys.argv[1])\n"
        "print(ensure_demo_checkpoints(models, {'small': 'small'}))  # already there: fine\n"
        "try:\n"
        "    ensure_demo_checkpoints(models, {'small': 'small', 'large': 'large'})\n"
        "except EngineNotInstalledError as exc:\n"
        "    print(exc)\n",
        str(short_tmp / "models"),
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.strip().splitlines()
    assert first == f"{{'small': PosixPath('{short_tmp}/models/small')}}"
    assert second.startswith("writing the demo models needs the inference engine")
    assert not (short_tmp / "models" / "large").exists()
    assert not (short_tmp / "models" / ".large.partial").exists()


@pytest.mark.skipif(not is_engine_installed(), reason="needs the engine (torch)")
def test_with_the_engine_its_commands_run_with_every_engine_flag() -> None:
    result = CliRunner().invoke(
        app, ["engine", "--help"], env={"COLUMNS": "300", "TERMINAL_WIDTH": "300"}
    )
    assert result.exit_code == 0, result.output
    assert "Usage: tollway engine [OPTIONS]" in result.output
    for name in EngineConfig.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in result.output
