"""How the launcher starts an engine: by the engine's own entry point, with ``spawn.args``
passed through to its flags (which are `EngineConfig`'s)."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from typer.testing import CliRunner

from backend_engine import cli as engine_cli
from backend_engine import config as engine_config
from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.server.app import build_app, uvicorn_config
from backend_engine.server.engine_host import EngineHost
from gateway.launcher import engine_processes
from gateway.launcher.engine_processes import EngineSpec, is_socket_healthy, is_socket_ready
from gateway.launcher.serve_config import config_plan
from tests.support.gguf_files import hf_tensors, write_gguf
from tests.support.polling import wait_until
from tests.support.stand_in_runner import DemoEngineModel
from tests.support.uvicorn_thread import start_in_thread, stop_thread


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
    assert where["uds"] == str(spec.socket_path)
    assert where["model_name"] == "small"


def test_spawn_quantization_settings_reach_the_engines_config(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = write_gguf(short_tmp / "m.gguf", hf_tensors(), tokenizer_pre="smollm")
    config = short_tmp / "tollway.yaml"
    config.write_text(
        "models:\n"
        "  small:\n"
        "    spawn: {checkpoint: m.gguf, quantization: int4, quantization_group_size: 64,\n"
        "            kv_cache_dtype: int8, args: [--seed, '3']}\n"
    )
    (spec,) = config_plan(config, short_tmp / "data", env={}).engines
    assert spec.command()[-8:] == [
        "--quantization",
        "int4",
        "--quantization-group-size",
        "64",
        "--kv-cache-dtype",
        "int8",
        "--seed",
        "3",
    ]
    started: list[EngineConfig] = []
    monkeypatch.setattr(engine_cli, "run_server", lambda config, **where: started.append(config))
    result = CliRunner().invoke(engine_cli.engine_app, spec.command()[3:])
    assert result.exit_code == 0, result.output
    assert started == [
        EngineConfig(
            model=str(checkpoint.resolve()),
            quantization="int4",
            quantization_group_size=64,
            kv_cache_dtype="int8",
            seed=3,
        )
    ]


def test_the_launchers_tables_are_the_engines() -> None:
    """The gateway cannot import the engine's config: its copies of the accepted values must
    stay the same as `EngineConfig`'s."""
    assert engine_processes.QUANTIZATIONS == engine_config.QUANTIZATIONS
    assert engine_processes.INT4_GROUP_SIZES == engine_config.INT4_GROUP_SIZES
    assert engine_processes.KV_CACHE_DTYPES == engine_config.KV_CACHE_DTYPES
    assert engine_processes.SPECULATIVE_PROPOSERS == engine_config.SPECULATIVE_PROPOSERS
    defaults = EngineConfig(model="m")
    assert defaults.speculative_ngram_min == engine_processes.DEFAULT_SPECULATIVE_NGRAM_MIN
    assert defaults.speculative_ngram_max == engine_processes.DEFAULT_SPECULATIVE_NGRAM_MAX


@pytest.mark.parametrize(
    ("spawn", "expected"),
    [
        (
            "speculative_proposer: ngram, num_speculative_tokens: 6, speculative_ngram_min: 1,\n"
            "            speculative_ngram_max: 3, speculative_crossover_batch_size: 2",
            {
                "speculative_proposer": "ngram",
                "num_speculative_tokens": 6,
                "speculative_ngram_min": 1,
                "speculative_ngram_max": 3,
                "speculative_crossover_batch_size": 2,
            },
        ),
        (
            "speculative_proposer: draft, speculative_draft_model: d.gguf",
            {"speculative_proposer": "draft", "speculative_draft_model": "d.gguf"},
        ),
    ],
)
def test_spawn_speculative_settings_reach_the_engines_config(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch, spawn: str, expected: dict[str, Any]
) -> None:
    """The draft model's path is relative to the config file, like the checkpoint's."""
    checkpoint = write_gguf(short_tmp / "m.gguf", hf_tensors(), tokenizer_pre="smollm")
    shutil.copyfile(checkpoint, short_tmp / "d.gguf")
    config = short_tmp / "tollway.yaml"
    config.write_text(
        f"models:\n  small:\n    spawn: {{checkpoint: m.gguf, {spawn},\n"
        "            args: [--seed, '3']}\n"
    )
    (spec,) = config_plan(config, short_tmp / "data", env={}).engines
    assert spec.command()[-2:] == ["--seed", "3"]
    started: list[EngineConfig] = []
    monkeypatch.setattr(engine_cli, "run_server", lambda config, **where: started.append(config))
    result = CliRunner().invoke(engine_cli.engine_app, spec.command()[3:])
    assert result.exit_code == 0, result.output
    if "speculative_draft_model" in expected:
        expected["speculative_draft_model"] = str((short_tmp / "d.gguf").resolve())
    assert started == [EngineConfig(model=str(checkpoint.resolve()), seed=3, **expected)]


def test_spawn_without_speculative_settings_adds_no_flags(short_tmp: Path) -> None:
    write_gguf(short_tmp / "m.gguf", hf_tensors(), tokenizer_pre="smollm")
    config = short_tmp / "tollway.yaml"
    config.write_text("models:\n  small:\n    spawn: {checkpoint: m.gguf}\n")
    (spec,) = config_plan(config, short_tmp / "data", env={}).engines
    assert spec.speculative is None
    assert not [arg for arg in spec.command() if "speculative" in arg]


def test_an_engine_is_ready_only_once_its_model_is_loaded(
    short_tmp: Path, demo_engine_model: Callable[..., DemoEngineModel]
) -> None:
    # What `EngineSupervisor.wait_until_healthy` waits for: /health answers from the start,
    # /ready once the model is loaded.
    model = demo_engine_model(size="tiny")
    config = EngineConfig(model=str(model.checkpoint), num_kv_blocks=64, show_progress=False)
    gate = threading.Event()

    async def load() -> AsyncEngine:
        await asyncio.to_thread(gate.wait, 120)
        return await AsyncEngine.load(config, "tiny", model.plan_runner)

    socket_path = short_tmp / "tiny.sock"
    app = build_app(load, host=EngineHost(config.drain_grace_s))
    server = uvicorn.Server(uvicorn_config(app, uds=str(socket_path), log_level="warning"))
    thread = start_in_thread(server)
    try:
        assert is_socket_healthy(socket_path)
        assert not is_socket_ready(socket_path)
        gate.set()
        wait_until(lambda: is_socket_ready(socket_path), 120, "the engine is ready")
    finally:
        gate.set()
        stop_thread(server, thread)
    assert not is_socket_healthy(socket_path)
    assert not is_socket_ready(socket_path)
