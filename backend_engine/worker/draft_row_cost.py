"""What scoring a draft token costs the target, measured once at start (speculative decoding).

A draft is one more row in its sequence's step. Where a step is bound by reading the weights
(a float32 model on this CPU, or a GPU) a row costs a few percent of the step; where each row is
real compute (a quantized model's integer kernels on this CPU) it costs most of one. The
adaptive k (:mod:`backend_engine.speculative.adaptive_k`) weighs that cost against a draft's
chance of being kept, so the runner measures it on its own model before any request: a step
of one token and ``k`` drafts against a step of one token, on scratch KV slots (every block is
free before the first request; whatever is written there is overwritten before it is read).
The fastest of a few interleaved runs each, after a warm-up (other work on a shared machine
only ever adds time): ~20 steps, a fraction of a second for SmolLM2-135M.
"""

from __future__ import annotations

import time

from backend_engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from backend_engine.core.step_runner import DraftRowCost, StepRunner
from backend_engine.sampling_params import SamplingParams

NUM_TIMED = 7  # interleaved pairs of timed steps
CONTEXT_TOKENS = 64  # tokens before the step's (a short conversation's worth of context)


def measure_draft_row_cost(
    runner: StepRunner, num_drafts: int, block_size: int, num_blocks: int
) -> DraftRowCost:
    """``(t(1 + num_drafts rows) - t(1 row)) / (num_drafts * t(1 row))``, 0 or more, and
    ``t(1 row)`` (both 0 where there is no room to measure)."""
    num_rows = num_drafts + 1
    context = min(CONTEXT_TOKENS, max(num_blocks * block_size - num_rows, 0))
    num_needed = -(-(context + num_rows) // block_size)
    if num_drafts < 1 or num_needed > num_blocks:
        return DraftRowCost(row_cost=0.0, step_seconds=0.0)
    table = list(range(num_needed))
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def step(rows: int) -> SchedulerOutput:
        item = ScheduledRequest(
            request_id="draft-row-cost",
            token_ids=[0] * rows,
            start_position=context,
            block_table=table,
            sampling_params=params,
            do_sample=True,
            is_decode=rows == 1,
            draft_token_ids=(0,) * (rows - 1),
        )
        return SchedulerOutput([item], [], [])

    plain, drafted = step(1), step(num_rows)

    def timed(output: SchedulerOutput) -> float:
        start = time.perf_counter()
        runner.execute(output)
        return time.perf_counter() - start

    for _ in range(2):  # warm-up: caches, lazy kernels, the allocator
        timed(plain)
        timed(drafted)
    plain_times, drafted_times = [], []
    for _ in range(NUM_TIMED):
        plain_times.append(timed(plain))
        drafted_times.append(timed(drafted))
    runner.release("draft-row-cost")
    one, more = min(plain_times), min(drafted_times)
    return DraftRowCost(row_cost=max((more - one) / (num_drafts * one), 0.0), step_seconds=one)
