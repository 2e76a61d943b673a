"""How the launcher starts an engine: by the engine's own entry point, with ``spawn.args``
passed through to its flags (which are `EngineConfig`'s)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from backend_engine import cli as engine_cli
from backend_engine.config import EngineConfig
from gateway.launcher.engine_processes import EngineSpec
from gateway.launcher.serve_config import config_plan
from tests.gguf_files import hf_tensors, write_gguf


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory: Unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="tw-proc-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_an_engine_is_started_as_python_m_backend_engine(short_tmp: Path) -> None:
    spec = EngineSpec("small", short_tmp / "m.gguf", short_tmp / "small.sock", device="cuda")
    assert spec.command() == [
        sys.executable,
        "-m",
        "backend_engine",
        "--model",
        str(short_tmp / "m.gguf"),
        "--uds",
        str(short_tmp / "small.sock"),
        "--served-model-name",
        "small",
        "--device",
        "cuda",
    ]


def test_engine_settings_in_spawn_args_reach_the_engines_config(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = write_gguf(short_tmp / "m.gguf", hf_tensors(), tokenizer_pre="smollm")
    config = short_tmp / "tollway.yaml"
    config.write_text(
        "models:\n"
        "  small:\n"
        "    spawn:\n"
        "      checkpoint: m.gguf\n"
        "      args: [--watermark, '0.05', --scheduling, static, --seed, '11',\n"
        "             --max-model-len, '256', --kv-cache-memory-bytes, '1048576']\n"
    )
    (spec,) = config_plan(config, short_tmp / "data", env={}).engines
    command = spec.command()
    assert command[:3] == [sys.executable, "-m", "backend_engine"]

    started: list[tuple[EngineConfig, dict[str, Any]]] = []
    monkeypatch.setattr(
        engine_cli, "run_server", lambda config, **where: started.append((config, where))
    )
    result = CliRunner().invoke(engine_cli.engine_app, command[3:])  # what the child parses
    assert result.exit_code == 0, result.output
    ((engine_config, where),) = started
    assert engine_config == EngineConfig(
        model=str(checkpoint.resolve()),
        device="cpu",
        watermark=0.05,
        scheduling="static",
        seed=11,
        max_model_len=256,
        kv_cache_memory_bytes=1 << 20,
    )
    assert where["uds"] == str(spec.socket_path) and where["model_name"] == "small"
