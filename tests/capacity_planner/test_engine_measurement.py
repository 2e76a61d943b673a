"""``--measure`` against a real engine process (``python -m backend_engine`` on the tiny demo
checkpoint, on a Unix socket): the rounds, the per-stream judgement, and the plan it feeds.
Without the engine (a gateway-only install) those skip, and one test measures the engine's own
server in this process with a stand-in for the model (``demo_engine_model``)."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvicorn
from typer.testing import CliRunner

from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.server.app import build_app
from capacity_planner.engine_measurement import LoadSpec, MeasurementError, measure_engine
from gateway.launcher.cli import app
from gateway.launcher.engine_processes import EngineProcess, EngineSpec, is_socket_ready
from tests.support.polling import wait_until
from tests.support.stand_in_runner import DemoEngineModel
from tests.support.uvicorn_thread import start_in_thread, stop_thread
from tests.support.without_engine import needs_engine


def test_measuring_the_engine_s_server_in_process(
    demo_engine_model: Callable[..., DemoEngineModel],
) -> None:
    model = demo_engine_model(size="tiny")
    tmp = tempfile.mkdtemp(prefix="tw-plan-")
    path = f"{tmp}/engine.sock"
    config = EngineConfig(model=str(model.checkpoint), max_num_seqs=8, show_progress=False)
    app = build_app(AsyncEngine(config, model_name="tiny", plan_runner=model.plan_runner))
    server = uvicorn.Server(
        uvicorn.Config(
            app, uds=path, loop="asyncio", http="h11", lifespan="on", log_level="warning"
        )
    )
    thread = start_in_thread(server)
    try:
        spec = LoadSpec(
            f"unix:{path}", prompt_tokens=16, output_tokens=6, stream_tokens_per_s=1,
            max_concurrency=2,
        )  # fmt: skip
        measurement = asyncio.run(measure_engine(spec))
    finally:
        stop_thread(server, thread)
        shutil.rmtree(tmp, ignore_errors=True)
    assert [r.concurrency for r in measurement.rounds] == [1, 2]
    assert all(s.completion_tokens == 6 for r in measurement.rounds for s in r.streams)
    assert measurement.best is not None
    assert measurement.gpu_throughput().source == "measured"


@pytest.fixture(scope="module")
def engine_url(demo_checkpoint: Callable[..., Path]) -> Iterator[str]:
    tmp = Path(tempfile.mkdtemp(prefix="tw-plan-"))  # short: a socket path stays under 108 B
    spec = EngineSpec(
        "tiny",
        demo_checkpoint(size="tiny"),
        tmp / "engine.sock",
        extra_args=("--no-show-progress",),
        env={"OMP_NUM_THREADS": "1"},
    )
    engine = EngineProcess(spec, tmp / "engine.log")
    try:
        wait_until(
            lambda: not engine.is_running() or is_socket_ready(spec.socket_path),
            timeout_s=120,
            what="the engine is ready",
        )
        engine.check_alive()
        yield f"unix:{spec.socket_path}"
    finally:
        engine.signal(signal.SIGKILL)
        engine.wait(10)
        engine.close_log()
        shutil.rmtree(tmp, ignore_errors=True)


@needs_engine
def test_rounds_double_until_the_limit_and_every_stream_is_timed(engine_url: str) -> None:
    spec = LoadSpec(
        engine_url, prompt_tokens=32, output_tokens=12, stream_tokens_per_s=1, max_concurrency=4
    )
    measurement = asyncio.run(measure_engine(spec))
    assert measurement.model == "tiny"  # from GET /v1/models
    assert [r.concurrency for r in measurement.rounds] == [1, 2, 4]
    for load_round in measurement.rounds:
        assert len(load_round.streams) == load_round.concurrency
        assert all(s.completion_tokens == 12 for s in load_round.streams)  # ignore_eos
        assert all(0 < s.first_token_s <= s.last_token_s for s in load_round.streams)
        assert load_round.output_tokens_per_s == pytest.approx(
            12 * load_round.concurrency / load_round.wall_s
        )
    best = measurement.best
    assert best is not None
    assert best.meets(1)
    assert best.output_tokens_per_s == max(r.output_tokens_per_s for r in measurement.rounds)
    # An engine on two GPUs: the per-GPU rate is half the engine's.
    assert measurement.gpu_throughput(2).output_tokens_per_s == best.output_tokens_per_s / 2


@needs_engine
def test_a_target_no_stream_reaches_stops_after_one_round(engine_url: str) -> None:
    spec = LoadSpec(engine_url, prompt_tokens=8, output_tokens=4, stream_tokens_per_s=1e9)
    measurement = asyncio.run(measure_engine(spec))
    assert [r.concurrency for r in measurement.rounds] == [1]
    assert measurement.best is None
    with pytest.raises(MeasurementError, match=r"no stream of tiny reached 1e\+09 tokens/s"):
        measurement.gpu_throughput()


@needs_engine
def test_plan_with_measure_uses_the_measured_rate(engine_url: str) -> None:
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "--measure",
            engine_url,
            "--measure-max-concurrency",
            "2",
            "--requests-per-day",
            "100000",
            "--peak-factor",
            "3",
            "--prompt-tokens",
            "16",
            "--output-tokens",
            "8",
            "--stream-tokens-per-s",
            "1",
            "--layers",
            "2",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--params",
            "1e6",
            "--gpu",
            "l4",
            "--format",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["gpu_throughput_source"] == "measured"
    rounds = plan["measurement"]["rounds"]
    assert [r["concurrency"] for r in rounds] == [1, 2]
    best = max(r["output_tokens_per_s"] for r in rounds if r["meets_target"])
    assert plan["gpu_output_tokens_per_s"] == best
    assert plan["gpus_at_peak"] >= plan["peak_output_tokens_per_s"] / best
