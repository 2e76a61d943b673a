"""Speculative decoding's cost of a draft row: measured by the runner at start, or configured."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from backend_engine import LLM
from backend_engine.core.scheduler_output import SchedulerOutput
from backend_engine.core.step_runner import RunnerOutput
from backend_engine.worker.draft_row_cost import measure_draft_row_cost

BASE_S = 0.004  # a one-token step of the stand-in below
PER_ROW_S = 0.002  # each draft row on top: half a step


class RowTimedRunner:
    """A step runner whose steps take ``BASE_S`` plus ``PER_ROW_S`` per draft row."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.rows: list[int] = []

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        rows = sum(item.num_tokens for item in output.scheduled)
        self.rows.append(rows)
        time.sleep(BASE_S + PER_ROW_S * (rows - 1))
        return RunnerOutput({}, {})

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def test_the_cost_is_a_draft_rows_time_over_a_one_token_steps() -> None:
    runner = RowTimedRunner()
    cost = measure_draft_row_cost(runner, num_drafts=4, block_size=16, num_blocks=8)
    assert 0.35 < cost.row_cost < 0.65  # 0.5, give or take the sleeps' overshoot
    assert BASE_S <= cost.step_seconds < 3 * BASE_S
    assert set(runner.rows) == {1, 5}
    assert runner.released == ["draft-row-cost"]


def test_no_room_for_the_scratch_step_measures_nothing() -> None:
    runner = RowTimedRunner()
    cost = measure_draft_row_cost(runner, num_drafts=4, block_size=2, num_blocks=2)
    assert (cost.row_cost, cost.step_seconds) == (0.0, 0.0)
    assert runner.rows == []


def test_an_engine_measures_it_on_its_model_before_any_request(
    demo_checkpoint: Callable[..., Path],
) -> None:
    llm = LLM(model=str(demo_checkpoint()), num_kv_blocks=64, speculative_proposer="ngram")
    speculator = llm.engine.speculator
    assert speculator is not None
    assert 0.0 <= speculator.settings.draft_cost < 10.0
    kv_cache = llm.engine.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_blocks
    assert not kv_cache.pool.cached_hashes  # the scratch step offered nothing to the cache


def test_a_configured_cost_is_taken_as_it_is(demo_checkpoint: Callable[..., Path]) -> None:
    llm = LLM(
        model=str(demo_checkpoint()),
        num_kv_blocks=64,
        speculative_proposer="ngram",
        speculative_draft_cost=0.25,
    )
    speculator = llm.engine.speculator
    assert speculator is not None
    assert speculator.settings.draft_cost == 0.25
