"""``n`` choices through the offline API: one prefill, then each choice decodes on its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from backend_engine import LLM, SamplingParams
from backend_engine.llm_engine import LLMEngine
from backend_engine.structured_output.constraint import OutputConstraint
from tests.backend_engine.conftest import GreedyReference

BLOCK_SIZE = 16
NUM_NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(demo_checkpoint: Callable[..., Path]) -> LLM:
    return LLM(model=str(demo_checkpoint(size="tiny")), dtype="float32", block_size=BLOCK_SIZE)


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_greedy_choices_are_identical_and_equal_the_single_answer(llm: LLM) -> None:
    prompts = [random_prompt(37, seed=1), random_prompt(20, seed=2)]
    single = llm.generate(prompts, GREEDY)
    outputs = llm.generate(prompts, replace(GREEDY, n=4))
    assert [(o.request_id, o.index) for o in outputs] == [
        (outputs[i // 4 * 4].request_id, i % 4) for i in range(8)
    ]
    assert outputs[0].request_id != outputs[4].request_id
    for p, out in enumerate(single):
        choices = outputs[4 * p : 4 * p + 4]
        assert [c.token_ids for c in choices] == [out.token_ids] * 4
        assert all(c.text == out.text and c.finish_reason == "length" for c in choices)
        assert all(c.prompt_token_ids == prompts[p] for c in choices)
    assert llm.engine.kv_cache.num_used_blocks == 0


def test_seeded_choices_are_reproducible_differ_and_choice_0_is_the_single_answer(
    llm: LLM,
) -> None:
    prompt = random_prompt(29, seed=3)
    four = replace(SEEDED, n=4)
    first = llm.generate([prompt], four)
    again = llm.generate([prompt], four)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert len({tuple(o.token_ids) for o in first}) == 4
    [single] = llm.generate([prompt], SEEDED)
    assert first[0].token_ids == single.token_ids


@pytest.mark.parametrize("length", [BLOCK_SIZE * 3 + 5, BLOCK_SIZE * 3], ids=["partial", "full"])
def test_the_prompt_is_prefilled_once(llm: LLM, length: int) -> None:
    engine = llm.engine
    before = engine.stats()
    outputs = llm.generate([random_prompt(length, seed=length)], replace(SEEDED, n=4))
    after = engine.stats()
    assert after.num_computed_prompt_tokens - before.num_computed_prompt_tokens == length
    assert after.num_prompt_tokens - before.num_prompt_tokens == length
    assert after.num_generation_tokens - before.num_generation_tokens == 4 * NUM_NEW_TOKENS
    assert [len(o.token_ids) for o in outputs] == [NUM_NEW_TOKENS] * 4
    assert after.num_kv_blocks_used == 0


def test_a_cached_prefix_is_not_counted_as_computed(llm: LLM) -> None:
    engine = llm.engine
    prompt = random_prompt(BLOCK_SIZE * 2 + 3, seed=9)
    llm.generate([prompt], GREEDY)
    before = engine.stats().num_computed_prompt_tokens
    llm.generate([prompt], replace(GREEDY, n=3))
    assert engine.stats().num_computed_prompt_tokens - before == 3  # past two cached blocks


def test_one_token_each_even_when_the_leader_stops_at_once(llm: LLM) -> None:
    prompt = random_prompt(21, seed=4)
    outputs = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5, max_tokens=1, n=5))
    assert [len(o.token_ids) for o in outputs] == [1] * 5
    assert all(o.finish_reason == "length" for o in outputs)
    # Then the forked choices' second tokens need their copied blocks: run them on.
    longer = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, n=3)
    [single] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert [o.token_ids for o in llm.generate([prompt], longer)] == [single.token_ids] * 3


def test_the_choices_run_in_turns_when_the_cache_holds_one_at_a_time(
    demo_checkpoint: Callable[..., Path],
) -> None:
    # 4 blocks of 16: a 40-token prompt and 20 new tokens need all of them, for one choice.
    small = LLM(
        model=str(demo_checkpoint(size="tiny")), dtype="float32", block_size=16, num_kv_blocks=4
    )
    prompt = random_prompt(40, seed=6)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    [single] = small.generate([prompt], params)
    outputs = small.generate([prompt], replace(params, n=3))
    assert [o.token_ids for o in outputs] == [single.token_ids] * 3
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.kv_cache.num_used_blocks == 0


def test_each_choice_has_its_own_grammar_matcher(llm: LLM) -> None:
    constraint = OutputConstraint.regex("(yes|no|maybe)( (yes|no|maybe)){2}", "structured_outputs")
    params = SamplingParams(temperature=1.0, seed=8, max_tokens=40, structured_output=constraint)
    outputs = llm.generate([random_prompt(18, seed=7)], replace(params, n=4))
    words = {"yes", "no", "maybe"}
    for out in outputs:
        assert out.finish_reason == "stop"
        parts = out.text.split(" ")
        assert len(parts) == 3, out.text
        assert set(parts) <= words, out.text


def test_deltas_carry_the_callers_id_and_their_choice(llm: LLM) -> None:
    engine: LLMEngine = llm.engine
    engine.add_request("mine", random_prompt(12, seed=10), replace(GREEDY, n=3))
    seen: dict[int, int] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.request_id == "mine"
            seen[delta.index] = seen.get(delta.index, 0) + len(delta.new_token_ids)
    assert seen == {0: NUM_NEW_TOKENS, 1: NUM_NEW_TOKENS, 2: NUM_NEW_TOKENS}


@pytest.mark.referee
def test_greedy_choices_equal_transformers(
    demo_checkpoint: Callable[..., Path], transformers_greedy: GreedyReference
) -> None:
    path = demo_checkpoint(size="tiny")
    prompts = [random_prompt(37, seed=11), random_prompt(BLOCK_SIZE * 2, seed=12)]
    expected = transformers_greedy(path, prompts, NUM_NEW_TOKENS)
    llm = LLM(model=str(path), dtype="float32", block_size=BLOCK_SIZE)
    outputs = llm.generate(prompts, replace(GREEDY, n=3))
    assert [o.token_ids for o in outputs] == [expected[0]] * 3 + [expected[1]] * 3
