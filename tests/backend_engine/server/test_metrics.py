"""The engine's counters as Prometheus renders them, and speculative decoding's through a real
engine's ``/metrics``."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import uvicorn

from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.outputs import EngineStats, SpeculativeCounts
from backend_engine.server.app import build_app, uvicorn_config
from backend_engine.server.metrics import ServerMetrics
from tests.support.uvicorn_thread import start_in_thread, stop_thread

MODEL_NAME = "tiny-demo"
# n-gram lookup drafts what followed the last tokens' earlier occurrence: a prompt that
# repeats itself, decoded greedily, makes drafts the tiny demo model keeps.
REPEATING_PROMPT = "one two three four five six. " * 6
SPEC_DECODE_PREFIX = "tollway_engine_spec_decode_"


IDLE = EngineStats(
    num_kv_blocks_total=64,
    num_kv_blocks_used=0,
    prefix_cache_queries=0,
    prefix_cache_hits=0,
    num_preemptions=0,
    num_waiting=0,
    num_running=0,
    num_prompt_tokens=0,
    num_generation_tokens=0,
)


def _render(stats: EngineStats) -> list[str]:
    return ServerMetrics(lambda: stats).render().decode().splitlines()


def test_prompt_tokens_computed_and_prefilled_are_two_counters() -> None:
    """A request with n = 4 choices counts its prompt once in both; a prefix-cache hit makes
    the computed count the smaller (here 100 prefilled, 68 of them computed)."""
    lines = _render(
        replace(
            IDLE,
            prefix_cache_queries=100,
            prefix_cache_hits=32,
            num_prompt_tokens=100,
            num_generation_tokens=40,
            num_computed_prompt_tokens=68,
        )
    )
    assert "tollway_engine_computed_prompt_tokens_total 68.0" in lines
    assert "tollway_engine_prompt_tokens_total 100.0" in lines
    assert "# TYPE tollway_engine_computed_prompt_tokens_total counter" in lines


def test_speculative_counts_are_counters_and_gauges_by_proposer() -> None:
    """10 sequence-steps scored 40 drafts and kept 30: a rate of 0.75, 3 kept a step."""
    lines = _render(replace(IDLE, speculative={"ngram": SpeculativeCounts(10, 40, 30)}))
    for line in (
        "# TYPE tollway_engine_spec_decode_draft_tokens_total counter",
        'tollway_engine_spec_decode_draft_tokens_total{proposer="ngram"} 40.0',
        'tollway_engine_spec_decode_accepted_tokens_total{proposer="ngram"} 30.0',
        'tollway_engine_spec_decode_verified_steps_total{proposer="ngram"} 10.0',
        "# TYPE tollway_engine_spec_decode_acceptance_rate gauge",
        'tollway_engine_spec_decode_acceptance_rate{proposer="ngram"} 0.75',
        "# TYPE tollway_engine_spec_decode_accepted_tokens_per_step gauge",
        'tollway_engine_spec_decode_accepted_tokens_per_step{proposer="ngram"} 3.0',
    ):
        assert line in lines, line


def test_a_proposer_that_scored_nothing_yet_has_rates_of_zero() -> None:
    lines = _render(replace(IDLE, speculative={"ngram": SpeculativeCounts()}))
    assert 'tollway_engine_spec_decode_acceptance_rate{proposer="ngram"} 0.0' in lines
    assert 'tollway_engine_spec_decode_accepted_tokens_per_step{proposer="ngram"} 0.0' in lines
    assert 'tollway_engine_spec_decode_draft_tokens_total{proposer="ngram"} 0.0' in lines


@contextmanager
def _serving(config: EngineConfig) -> Iterator[tuple[str, AsyncEngine]]:
    """A real engine's server on a free local port: its base URL and its engine."""
    engine = AsyncEngine(config, model_name=MODEL_NAME)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn_config(build_app(engine), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = start_in_thread(server, [sock])
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        stop_thread(server, thread)
        sock.close()


def _complete_and_scrape(base_url: str) -> dict[str, float]:
    """Complete the repeating prompt greedily, then scrape ``/metrics``: sample -> value."""
    body = {
        "model": MODEL_NAME,
        "prompt": REPEATING_PROMPT,
        "temperature": 0,
        "max_tokens": 24,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=base_url, timeout=120.0, trust_env=False) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        response = client.get("/metrics")
    assert response.status_code == 200
    values = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _config(checkpoint: Path) -> EngineConfig:
    return EngineConfig(model=str(checkpoint), num_kv_blocks=128, show_progress=False)


def test_an_ngram_engine_exports_its_drafts(demo_checkpoint: Callable[..., Path]) -> None:
    config = replace(_config(demo_checkpoint()), speculative_proposer="ngram")
    with _serving(config) as (base_url, engine):
        values = _complete_and_scrape(base_url)
        (counts,) = engine.stats().speculative.values()

    def value(name: str) -> float:
        return values[f'{SPEC_DECODE_PREFIX}{name}{{proposer="ngram"}}']

    assert counts.num_accepted_tokens > 0, "the repeating prompt's drafts were all rejected"
    assert value("draft_tokens_total") == counts.num_draft_tokens
    assert value("accepted_tokens_total") == counts.num_accepted_tokens
    assert value("verified_steps_total") == counts.num_verified_chunks > 0
    assert value("acceptance_rate") == pytest.approx(counts.acceptance_rate)
    assert 0 < value("acceptance_rate") <= 1
    assert value("accepted_tokens_per_step") == pytest.approx(
        counts.num_accepted_tokens / counts.num_verified_chunks
    )
    assert values["tollway_engine_generation_tokens_total"] == 24


def test_an_engine_that_does_not_speculate_exports_no_draft_metrics(
    demo_checkpoint: Callable[..., Path],
) -> None:
    with _serving(_config(demo_checkpoint())) as (base_url, _):
        values = _complete_and_scrape(base_url)
    assert values["tollway_engine_generation_tokens_total"] == 24
    assert not [name for name in values if name.startswith(SPEC_DECODE_PREFIX)]
