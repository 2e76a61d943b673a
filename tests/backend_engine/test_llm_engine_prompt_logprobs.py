"""Prompt logprobs through the engine's loop (behind the stand-in runner, so without torch):
whole across prefill chunks and preemptions, on the first delta only, never from the cache."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backend_engine.config import EngineConfig
from backend_engine.llm_engine import LLMEngine
from backend_engine.outputs import RequestOutputDelta
from backend_engine.sampling_params import SamplingParams
from tests.support.stand_in_runner import StandInRunner, plan_stand_in_runner

PROMPT = "Once upon a time there was a cat who sat on the mat and looked at the moon"


def engine_of(checkpoint: Path, **config: Any) -> LLMEngine:
    engine_config = EngineConfig(model=str(checkpoint), show_progress=False, **config)
    return LLMEngine(engine_config, plan_stand_in_runner(step_s=0))


def run(
    engine: LLMEngine, requests: dict[str, SamplingParams]
) -> dict[str, list[RequestOutputDelta]]:
    deltas: dict[str, list[RequestOutputDelta]] = {rid: [] for rid in requests}
    for rid, params in requests.items():
        engine.add_request(rid, PROMPT, params)
    while engine.has_unfinished():
        for delta in engine.step():
            deltas[delta.request_id].append(delta)
    return deltas


def assert_stand_in_prompt_logprobs(engine: LLMEngine, deltas: list[RequestOutputDelta]) -> None:
    assert deltas[0].prompt_logprobs is not None
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    prompt = engine.tokenize(PROMPT)
    entries = deltas[0].prompt_logprobs
    assert len(entries) == len(prompt)
    assert entries[0] is None
    runner = engine.runner
    assert isinstance(runner, StandInRunner)
    chosen = math.log(0.5 + 0.5 / runner.vocab_size)
    rest = math.log(0.5 / runner.vocab_size)
    for j, entry in enumerate(entries[1:], start=1):
        assert entry is not None
        word = runner.words[j % len(runner.words)]
        assert entry.token_id == prompt[j]
        assert entry.logprob == (chosen if prompt[j] == word else rest)
        assert entry.top[0] == (word, chosen)
        assert len(entry.top) == 2


def test_they_are_whole_across_prefill_chunks(demo_model_files: Callable[..., Path]) -> None:
    engine = engine_of(demo_model_files(size="tiny"), max_num_batched_tokens=5)
    asks = SamplingParams(max_tokens=3, prompt_logprobs=2)
    deltas = run(engine, {"asks": asks, "plain": SamplingParams(max_tokens=3)})
    assert_stand_in_prompt_logprobs(engine, deltas["asks"])
    assert all(d.prompt_logprobs is None for d in deltas["plain"])


def test_a_preempted_request_reports_them_once(demo_model_files: Callable[..., Path]) -> None:
    engine = engine_of(
        demo_model_files(size="tiny"), num_kv_blocks=14, block_size=4, max_num_batched_tokens=8
    )
    asks = SamplingParams(max_tokens=12, prompt_logprobs=2)
    deltas = run(engine, {f"r{i}": asks for i in range(3)})
    assert engine.scheduler.num_preemptions > 0
    for rid in deltas:
        assert_stand_in_prompt_logprobs(engine, deltas[rid])


def test_a_cached_prefix_does_not_stand_in_for_them(demo_model_files: Callable[..., Path]) -> None:
    engine = engine_of(demo_model_files(size="tiny"), block_size=4)
    run(engine, {"warm": SamplingParams(max_tokens=2)})
    again = run(engine, {"plain": SamplingParams(max_tokens=2)})
    assert (again["plain"][-1].num_cached_tokens or 0) > 0
    asks = run(engine, {"asks": SamplingParams(max_tokens=2, prompt_logprobs=2)})
    assert asks["asks"][-1].num_cached_tokens == 0
    assert_stand_in_prompt_logprobs(engine, asks["asks"])
