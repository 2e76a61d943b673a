"""The runner's side of ``n`` choices: KV block copies, and forks sampled from their leader's
logits row, each with its own settings and generator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from backend_engine.config import EngineConfig
from backend_engine.core.kv_cache_manager import BlockCopy
from backend_engine.core.scheduler import SchedulerOutput
from backend_engine.core.step_runner import RunnerOutput
from backend_engine.llm_engine import LLMEngine
from backend_engine.sampling_params import SamplingParams, choice_seed
from backend_engine.worker.model_runner import ModelRunner

PROMPT = [5, 9, 23, 77, 14, 3, 61, 8, 41, 12, 30]


@pytest.fixture(scope="module")
def engine(demo_checkpoint: Callable[..., Path]) -> LLMEngine:
    config = EngineConfig(
        model=str(demo_checkpoint(size="tiny")), dtype="float32", show_progress=False
    )
    return LLMEngine(config)


def runner_of(engine: LLMEngine) -> ModelRunner:
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    return runner


def first_step(engine: LLMEngine, rid: str, params: SamplingParams) -> RunnerOutput:
    """The runner's output for the step that prefills ``rid``; then ``rid`` is aborted."""
    engine.add_request(rid, PROMPT, params)
    output = engine.scheduler.schedule()
    try:
        return engine.runner.execute(output)
    finally:
        engine.abort([rid])
        assert not engine.has_unfinished()


def test_block_copies_copy_k_and_v_of_every_layer_reading_every_source_first(
    engine: LLMEngine,
) -> None:
    runner = runner_of(engine)
    generator = torch.Generator().manual_seed(0)
    for k_cache, v_cache in runner.kv_caches:
        k_cache.copy_(torch.randn(k_cache.shape, generator=generator))
        v_cache.copy_(torch.randn(v_cache.shape, generator=generator))
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    # Block 2 is both a source and, after it was read, a destination.
    runner.copy_blocks([BlockCopy(2, 5), BlockCopy(1, 2), BlockCopy(1, 7)])
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        for cache, old in ((k, k0), (v, v0)):
            assert torch.equal(cache[5], old[2])
            assert torch.equal(cache[2], old[1])
            assert torch.equal(cache[7], old[1])
            untouched = [i for i in range(cache.shape[0]) if i not in (2, 5, 7)]
            assert torch.equal(cache[untouched], old[untouched])
    assert len(runner.kv_caches) == engine.model_config.num_hidden_layers > 1


def test_an_empty_step_still_copies(engine: LLMEngine) -> None:
    runner = runner_of(engine)
    k_cache, v_cache = runner.kv_caches[-1]
    k_cache[3].fill_(1.5)
    v_cache[3].fill_(-2.5)
    runner.execute(SchedulerOutput([], [], [], (BlockCopy(3, 4),)))
    assert torch.equal(k_cache[4], k_cache[3])
    assert torch.equal(v_cache[4], v_cache[3])


def test_forks_are_sampled_from_their_leaders_row_with_their_own_settings(
    engine: LLMEngine,
) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4, logprobs=2)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=4, logprobs=2)
    engine.add_request("group", PROMPT, replace(seeded, n=3))
    leader = engine.scheduler.requests["group"]
    leader.pending_forks[0].sampling_params = greedy  # choice 1 greedy, choice 2 seeded
    output = engine.scheduler.schedule()
    [item] = output.scheduled
    assert [f.request_id for f in item.forks] == ["group#1", "group#2"]
    result = engine.runner.execute(output)
    engine.abort(["group", "group#1", "group#2"])
    assert not result.failed

    # Each as a request of its own, from the same prompt (so the same logits row).
    alone_greedy = first_step(engine, "alone-greedy", greedy).sampled["alone-greedy"]
    alone_0 = first_step(engine, "alone-0", seeded).sampled["alone-0"]
    seed_2 = replace(seeded, seed=choice_seed(11, 2))
    alone_2 = first_step(engine, "alone-2", seed_2).sampled["alone-2"]
    assert result.sampled["group#1"] == alone_greedy
    assert result.sampled["group"] == alone_0
    assert result.sampled["group#2"] == alone_2


def test_a_fork_whose_sampling_fails_fails_alone(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=4, n=3)
    engine.add_request("group", PROMPT, params)
    bad = engine.scheduler.requests["group#1"]
    bad.sampling_params = replace(bad.sampling_params)
    object.__setattr__(bad.sampling_params, "top_k", 10**20)  # past the tensor's 64 bits
    output = engine.scheduler.schedule()
    result = engine.runner.execute(output)
    engine.abort(["group", "group#1", "group#2"])
    assert set(result.failed) == {"group#1"}
    assert set(result.sampled) == {"group", "group#2"}
