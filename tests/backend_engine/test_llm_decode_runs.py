"""Decode runs through the engine (``backend_engine.core.decode_runs``): greedy requests get the
same tokens, text and finish reasons as step by step, in fewer engine steps; requests that
sample, or ask for logprobs, go step by step beside them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from backend_engine import LLM, SamplingParams
from backend_engine.outputs import RequestOutput


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def checkpoint(demo_checkpoint: Callable[..., Path]) -> Path:
    return demo_checkpoint(size="tiny")


def make_llm(path: Path, decode_run_steps: int) -> LLM:
    return LLM(
        model=str(path),
        dtype="float32",
        block_size=16,
        decode_run_steps=decode_run_steps,
        decode_run_max_ms=1e6,  # the test's steps are never too slow for a run
    )


@pytest.fixture(scope="module")
def stepwise(checkpoint: Path) -> LLM:
    return make_llm(checkpoint, decode_run_steps=1)


@pytest.fixture(scope="module")
def running(checkpoint: Path) -> LLM:
    return make_llm(checkpoint, decode_run_steps=8)


def generate_counting_steps(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[list[RequestOutput], int]:
    """The outputs, and how many engine steps they took."""
    engine = llm.engine
    counted = engine.step
    num_steps = 0

    def step() -> Any:
        nonlocal num_steps
        num_steps += 1
        return counted()

    engine.step = step  # type: ignore[method-assign]
    try:
        outputs = llm.generate(prompts, params)
    finally:
        del engine.step
    return outputs, num_steps


def summary(outputs: list[RequestOutput]) -> list[tuple[list[int], str, str | None]]:
    return [(o.token_ids, o.text, o.finish_reason) for o in outputs]


@pytest.mark.parametrize("path", ["native", "layer by layer"])
def test_greedy_outputs_match_step_by_step_in_fewer_steps(
    stepwise: LLM, running: LLM, path: str
) -> None:
    prompts = [random_prompt(9 + 7 * i, seed=i) for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 23, 5)]
    model = running.engine.runner.model  # type: ignore[attr-defined]
    decoder = model.native_decoder
    assert decoder is not None
    assert decoder.tokens is not None  # a run's steps are native calls from token ids

    want, num_stepwise = generate_counting_steps(stepwise, prompts, params)
    if path != "native":
        model.native_decoder = None
    try:
        got, num_running = generate_counting_steps(running, prompts, params)
    finally:
        model.native_decoder = decoder

    assert summary(got) == summary(want)
    assert [len(o.token_ids) for o in got] == [40, 23, 5]
    assert num_running < num_stepwise / 2


def test_a_run_stops_on_eos_and_stop_strings_where_steps_would(stepwise: LLM, running: LLM) -> None:
    prompts = [random_prompt(12, seed=10 + i) for i in range(4)]
    free = SamplingParams(temperature=0, max_tokens=48)
    [reference] = stepwise.generate(prompts[:1], [free])
    text = reference.text
    assert len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a string the output meets mid-run
    eos_token = reference.token_ids[20]  # stands in for eos: it ends the output there
    params = [
        free,
        SamplingParams(temperature=0, max_tokens=48, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[eos_token]),
    ]
    same_prompt = [prompts[0]] * len(params)

    assert summary(running.generate(same_prompt, params)) == summary(
        stepwise.generate(same_prompt, params)
    )
    [stopped] = running.generate(prompts[:1], [params[1]])
    assert stopped.finish_reason == "stop"
    assert len(stopped.text) < len(text)


def test_sampling_and_logprobs_requests_run_beside_greedy_ones(stepwise: LLM, running: LLM) -> None:
    prompts = [random_prompt(10, seed=20 + i) for i in range(3)]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, max_tokens=24, ignore_eos=True),
    ]
    want = stepwise.generate(prompts, params)
    got = running.generate(prompts, params)
    assert summary(got) == summary(want)
    assert [o.logprobs for o in got] == [o.logprobs for o in want]


def test_the_kv_blocks_all_come_back(running: LLM) -> None:
    engine = running.engine
    free_before = engine.kv_cache.num_free_blocks
    prompts = [random_prompt(30, seed=30 + i) for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (7, 19, 33, 50)]
    running.generate(prompts, params)
    assert not engine.has_unfinished()
    assert engine.kv_cache.num_free_blocks == free_before
