"""The engine's counters as Prometheus renders them."""

from __future__ import annotations

from backend_engine.outputs import EngineStats
from backend_engine.server.metrics import ServerMetrics


def test_prompt_tokens_computed_and_prefilled_are_two_counters() -> None:
    """A request with n = 4 choices counts its prompt once in both; a prefix-cache hit makes
    the computed count the smaller (here 100 prefilled, 68 of them computed)."""
    stats = EngineStats(
        num_kv_blocks_total=64,
        num_kv_blocks_used=0,
        prefix_cache_queries=100,
        prefix_cache_hits=32,
        num_preemptions=0,
        num_waiting=0,
        num_running=0,
        num_prompt_tokens=100,
        num_generation_tokens=40,
        num_computed_prompt_tokens=68,
    )
    lines = ServerMetrics(lambda: stats).render().decode().splitlines()
    assert "tollway_engine_computed_prompt_tokens_total 68.0" in lines
    assert "tollway_engine_prompt_tokens_total 100.0" in lines
    assert "# TYPE tollway_engine_computed_prompt_tokens_total counter" in lines
