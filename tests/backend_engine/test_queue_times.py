"""Queue time per priority class: from a request's acceptance to its first admission, as the
engine counts it (`EngineStats.queue_times`) and as /metrics renders it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from backend_engine.config import EngineConfig
from backend_engine.llm_engine import LLMEngine
from backend_engine.outputs import QUEUE_TIME_BUCKETS, EngineStats, QueueTimes
from backend_engine.request_priority import Priority
from backend_engine.sampling_params import SamplingParams
from backend_engine.server.metrics import ServerMetrics
from tests.support.stand_in_runner import plan_stand_in_runner

STEP_S = 0.02


def test_a_request_waiting_for_a_sequence_slot_counts_its_wait_in_its_class(
    demo_checkpoint: Callable[..., Path],
) -> None:
    config = EngineConfig(
        model=str(demo_checkpoint(size="tiny")), max_num_seqs=1, show_progress=False
    )
    engine = LLMEngine(config, plan_stand_in_runner(step_s=STEP_S))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    engine.add_request("first", [5, 6, 7], params)
    engine.add_request("second", [5, 6, 8], params, priority=Priority.BATCH)
    while engine.has_unfinished():
        engine.step()
    times = engine.stats().queue_times
    assert set(times) == {"interactive", "batch"}
    assert sum(times["interactive"].counts) == 1
    assert sum(times["batch"].counts) == 1
    # "second" waited for "first"'s five steps (one sequence at a time); "first" for none.
    assert times["batch"].sum_s >= 4 * STEP_S
    assert times["interactive"].sum_s < times["batch"].sum_s


def test_queue_times_render_as_a_histogram_by_priority() -> None:
    counts = [0] * (len(QUEUE_TIME_BUCKETS) + 1)
    counts[0], counts[-1] = 2, 1  # two under 5 ms, one past the largest bound
    stats = EngineStats(
        num_kv_blocks_total=8,
        num_kv_blocks_used=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        num_waiting=0,
        num_running=0,
        num_prompt_tokens=0,
        num_generation_tokens=0,
        queue_times={"batch": QueueTimes(tuple(counts), 95.0)},
    )
    lines = ServerMetrics(lambda: stats).render().decode().splitlines()
    assert 'tollway_engine_queue_time_seconds_bucket{le="0.005",priority="batch"} 2.0' in lines
    assert 'tollway_engine_queue_time_seconds_bucket{le="60.0",priority="batch"} 2.0' in lines
    assert 'tollway_engine_queue_time_seconds_bucket{le="+Inf",priority="batch"} 3.0' in lines
    assert 'tollway_engine_queue_time_seconds_count{priority="batch"} 3.0' in lines
    assert 'tollway_engine_queue_time_seconds_sum{priority="batch"} 95.0' in lines
