"""Speculative decoding through the offline API, greedy: the same tokens, text, finish reason
and logprobs as without it, whatever else the engine does meanwhile.

The demo checkpoint's random weights fall into loops when decoding greedily, and a prompt
that repeats a segment gives the n-gram proposer matches from the start, so drafts are
proposed and kept; every test checks the speculative counts grew (else it proves nothing).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from backend_engine import LLM, SamplingParams
from backend_engine.outputs import RequestOutput, RequestOutputDelta, SpeculativeCounts
from backend_engine.structured_output.constraint import OutputConstraint
from tests.support.scripted_proposer import ScriptedProposer

BLOCK_SIZE = 16
NUM_NEW_TOKENS = 48
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
SPECULATIVE: dict[str, Any] = {
    "speculative_proposer": "ngram",
    "speculative_ngram_min": 1,
    "num_speculative_tokens": 4,
    "speculative_crossover_batch_size": 64,  # these tests' batches all speculate
    "speculative_draft_cost": 0.0,  # drafts free: k follows acceptance alone
}


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def repeating_prompt(seed: int, segment: int = 12, times: int = 4) -> list[int]:
    return random_prompt(segment, seed) * times


def make_llm(path: Path, *, speculative: bool, **options: Any) -> LLM:
    settings: dict[str, Any] = {"dtype": "float32", "block_size": BLOCK_SIZE, **options}
    if speculative:
        settings.update(SPECULATIVE)
    return LLM(model=str(path), **settings)


@pytest.fixture(scope="module")
def checkpoint(demo_checkpoint: Callable[..., Path]) -> Path:
    return demo_checkpoint(size="tiny")


@pytest.fixture(scope="module")
def plain(checkpoint: Path) -> LLM:
    return make_llm(checkpoint, speculative=False)


@pytest.fixture(scope="module")
def speculating(checkpoint: Path) -> LLM:
    return make_llm(checkpoint, speculative=True)


@pytest.fixture(scope="module")
def scripted(checkpoint: Path) -> LLM:
    """Speculating, with a :class:`ScriptedProposer` each test installs (``script``)."""
    return make_llm(checkpoint, speculative=True)


def script(llm: LLM, references: dict[tuple[int, ...], list[int]]) -> None:
    """Make ``llm`` propose each prompt's reference continuation (always right)."""
    speculator = llm.engine.speculator
    assert speculator is not None
    speculator.proposer = ScriptedProposer(references, llm.engine.model_config.vocab_size)


def counts(llm: LLM) -> SpeculativeCounts:
    by_proposer = llm.engine.stats().speculative
    assert len(by_proposer) == 1
    return next(iter(by_proposer.values()))


def generate_counted(
    llm: LLM, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams]
) -> tuple[list[RequestOutput], SpeculativeCounts]:
    """The outputs, and the drafts scored and kept while making them."""
    before = counts(llm)
    outputs = llm.generate(list(prompts), params)
    after = counts(llm)
    return outputs, SpeculativeCounts(
        after.num_verified_chunks - before.num_verified_chunks,
        after.num_draft_tokens - before.num_draft_tokens,
        after.num_accepted_tokens - before.num_accepted_tokens,
    )


def assert_same_outputs(spec: list[RequestOutput], ref: list[RequestOutput]) -> None:
    assert [(o.token_ids, o.text, o.finish_reason, o.index) for o in spec] == [
        (o.token_ids, o.text, o.finish_reason, o.index) for o in ref
    ]


def assert_same_logprobs(spec: list[RequestOutput], ref: list[RequestOutput]) -> None:
    for got, want in zip(spec, ref, strict=True):
        assert got.logprobs is not None
        assert want.logprobs is not None
        assert len(got.logprobs) == len(want.logprobs) == len(want.token_ids)
        for g, w in zip(got.logprobs, want.logprobs, strict=True):
            assert g.token_id == w.token_id
            assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
            assert [t for t, _ in g.top] == [t for t, _ in w.top]
            assert [lp for _, lp in g.top] == pytest.approx([lp for _, lp in w.top], abs=1e-4)


def assert_speculated(delta: SpeculativeCounts, min_accepted: int = 1) -> None:
    assert delta.num_draft_tokens > 0, "no draft was proposed: the test proves nothing"
    assert delta.num_accepted_tokens >= min_accepted, f"too few drafts kept: {delta}"


def step_deltas(llm: LLM, prompt: list[int], params: SamplingParams) -> list[RequestOutputDelta]:
    """One request's deltas, one per engine step that gave it tokens."""
    engine = llm.engine
    request = engine.make_request("deltas", prompt, params)
    engine.add(request)
    deltas: list[RequestOutputDelta] = []
    while engine.has_unfinished():
        deltas.extend(engine.step())
    return deltas


def multi_token_runs(deltas: list[RequestOutputDelta]) -> list[tuple[int, int]]:
    """(first output index, number of tokens) of each step that emitted several tokens."""
    runs, position = [], 0
    for delta in deltas:
        if len(delta.new_token_ids) > 1:
            runs.append((position, len(delta.new_token_ids)))
        position += len(delta.new_token_ids)
    return runs


def test_a_batch_mixing_speculating_and_plain_sequences(plain: LLM, speculating: LLM) -> None:
    prompts = [
        repeating_prompt(1),
        random_prompt(30, seed=2),  # no repeats in the prompt
        repeating_prompt(3),
        random_prompt(25, seed=4),
        repeating_prompt(5, segment=7, times=6),
    ]
    params = [
        GREEDY,
        GREEDY,
        replace(GREEDY, max_tokens=1),  # no decode step: nothing to draft after
        replace(GREEDY, max_tokens=2),  # one decode: its drafts could never pay
        replace(GREEDY, max_tokens=33),
    ]
    ref = plain.generate(prompts, params)
    spec, delta = generate_counted(speculating, prompts, params)
    assert_same_outputs(spec, ref)
    assert [len(o.token_ids) for o in spec] == [48, 48, 1, 2, 33]
    assert_speculated(delta, min_accepted=5)
    assert speculating.engine.kv_cache.num_used_blocks == 0


def test_every_max_tokens_ends_at_the_same_token(plain: LLM, speculating: LLM) -> None:
    """max_tokens from 1 to 40 on one looping prompt: each one's limit falls somewhere in or
    after a run of kept drafts, and each stops on exactly that many tokens."""
    prompt = repeating_prompt(11)
    params = [replace(GREEDY, max_tokens=m) for m in range(1, 41)]
    ref = plain.generate([prompt] * 40, params)
    spec, delta = generate_counted(speculating, [prompt] * 40, params)
    assert_same_outputs(spec, ref)
    assert [len(o.token_ids) for o in spec] == list(range(1, 41))
    assert all(o.finish_reason == "length" for o in spec)
    assert_speculated(delta, min_accepted=10)


def test_prefix_cache_hits(plain: LLM, speculating: LLM) -> None:
    prompt = repeating_prompt(21, segment=10, times=5)  # 50 tokens: three full blocks
    ref = plain.generate([prompt], GREEDY)
    first, delta_first = generate_counted(speculating, [prompt], GREEDY)
    again, delta_again = generate_counted(speculating, [prompt, prompt], [GREEDY, GREEDY])
    assert_same_outputs(first, ref)
    assert_same_outputs(again, ref * 2)
    assert [o.num_cached_tokens for o in again] == [3 * BLOCK_SIZE] * 2
    assert_speculated(delta_first)
    assert_speculated(delta_again)


def test_a_forced_preemption(checkpoint: Path, plain: LLM) -> None:
    # 10 blocks of 16 tokens; four 40-token prompts with 40 new tokens need 5 blocks each.
    small = make_llm(checkpoint, speculative=True, num_kv_blocks=10)
    prompts = [repeating_prompt(30 + i, segment=8, times=5) for i in range(4)]
    params = replace(GREEDY, max_tokens=40)
    ref = plain.generate(prompts, params)
    spec, delta = generate_counted(small, prompts, params)
    assert_same_outputs(spec, ref)
    assert small.engine.scheduler.num_preemptions > 0
    assert_speculated(delta, min_accepted=10)
    assert small.engine.kv_cache.num_used_blocks == 0


def test_n_choices(plain: LLM, speculating: LLM) -> None:
    prompts = [repeating_prompt(41), random_prompt(20, seed=42)]
    params = replace(GREEDY, n=3)
    ref = plain.generate(prompts, params)
    spec, delta = generate_counted(speculating, prompts, params)
    assert_same_outputs(spec, ref)
    assert len(spec) == 6
    assert_speculated(delta, min_accepted=5)


def test_logprobs_are_the_targets_for_kept_drafts(plain: LLM, speculating: LLM) -> None:
    prompts = [repeating_prompt(51), repeating_prompt(52, segment=9, times=5)]
    params = replace(GREEDY, logprobs=3)
    ref = plain.generate(prompts, params)
    spec, delta = generate_counted(speculating, prompts, params)
    assert_same_outputs(spec, ref)
    assert_speculated(delta, min_accepted=5)
    assert_same_logprobs(spec, ref)


@pytest.mark.parametrize(
    "penalties",
    [
        {"frequency_penalty": 0.4},
        {"presence_penalty": 0.3, "repetition_penalty": 1.1},
        {"logit_bias": {7: 3.0, 100: -50.0}},
    ],
    ids=["frequency", "presence-repetition", "logit-bias"],
)
def test_penalties_and_logit_bias_see_the_drafts_as_history(
    plain: LLM, scripted: LLM, penalties: dict[str, Any]
) -> None:
    """Drafts that are the target's own tokens are all kept only if each row's penalties
    count the drafts before it (a row that missed them would choose another token); the
    logprobs are the processed rows', as a decode's are."""
    prompts = [repeating_prompt(61), random_prompt(30, seed=62)]
    params = replace(GREEDY, logprobs=2, **penalties)
    ref = plain.generate(prompts, params)
    script(scripted, {tuple(p): o.token_ids for p, o in zip(prompts, ref, strict=True)})
    spec, delta = generate_counted(scripted, prompts, params)
    assert_same_outputs(spec, ref)
    assert_same_logprobs(spec, ref)
    assert_speculated(delta, min_accepted=30)
    assert delta.num_accepted_tokens == delta.num_draft_tokens


def first_occurrence_in_run(tokens: list[int], deltas: list[RequestOutputDelta]) -> int:
    """An output position inside a step's kept run, not its last token, whose token appears
    there for the first time."""
    for start, size in multi_token_runs(deltas):
        for position in range(start, start + size - 1):
            if position > 0 and tokens.index(tokens[position]) == position:
                return position
    raise AssertionError("no token occurs first inside a kept run: the test proves nothing")


def test_a_stop_string_inside_a_kept_run(plain: LLM, scripted: LLM) -> None:
    """The stop string ends at a token in the middle of a step's kept drafts: the text stops
    where it would without speculation, and the tokens after it in that step are dropped."""
    prompt = random_prompt(40, seed=71)
    [full] = plain.generate([prompt], GREEDY)
    script(scripted, {tuple(prompt): full.token_ids})
    deltas = step_deltas(scripted, prompt, GREEDY)
    assert [t for d in deltas for t in d.new_token_ids] == full.token_ids
    position = first_occurrence_in_run(full.token_ids, deltas)
    tokenizer = plain.tokenizer
    before = tokenizer.decode(full.token_ids[:position])
    through = tokenizer.decode(full.token_ids[: position + 1])
    assert len(through) > len(before)
    assert through.startswith(before)
    # The stop string: this token's text, and the character before it (if unique so far).
    stop = through[max(len(before) - 1, 0) :]
    assert full.text.find(stop) == len(through) - len(stop), "the stop string occurs earlier"
    params = replace(GREEDY, stop=[stop])
    [ref] = plain.generate([prompt], params)
    [spec], delta = generate_counted(scripted, [prompt], params)
    assert_same_outputs([spec], [ref])
    assert ref.finish_reason == "stop"
    assert ref.text == full.text[: full.text.find(stop)]
    assert len(ref.token_ids) == position + 1
    assert_speculated(delta)
    final = step_deltas(scripted, prompt, params)[-1]
    assert (final.finished, final.num_completion_tokens) == (True, position + 1)


def test_a_stop_token_inside_a_kept_run(plain: LLM, scripted: LLM) -> None:
    prompt = random_prompt(40, seed=81)
    [full] = plain.generate([prompt], GREEDY)
    script(scripted, {tuple(prompt): full.token_ids})
    deltas = step_deltas(scripted, prompt, GREEDY)
    position = first_occurrence_in_run(full.token_ids, deltas)
    params = replace(GREEDY, stop_token_ids=[full.token_ids[position]])
    [ref] = plain.generate([prompt], params)
    [spec], delta = generate_counted(scripted, [prompt], params)
    assert_same_outputs([spec], [ref])
    assert ref.finish_reason == "stop"
    assert spec.token_ids == full.token_ids[: position + 1]
    assert_speculated(delta)
    final = step_deltas(scripted, prompt, params)[-1]
    assert (final.finished, final.num_completion_tokens) == (True, position + 1)
    assert scripted.engine.kv_cache.num_used_blocks == 0


CHOICES = {
    "type": "array",
    "items": {"enum": ["yes", "no", "maybe"]},
    "minItems": 8,
    "maxItems": 8,
}


def test_a_structured_output(plain: LLM, speculating: LLM) -> None:
    constraint = OutputConstraint.json_schema(CHOICES, "response_format")
    prompts = [repeating_prompt(91), random_prompt(20, seed=92)]
    params = SamplingParams(temperature=0, max_tokens=120, structured_output=constraint)
    ref = plain.generate(prompts, params)
    spec, delta = generate_counted(speculating, prompts, params)
    assert_same_outputs(spec, ref)
    for out in spec:
        assert out.finish_reason == "stop"
        assert len(json.loads(out.text)) == 8
    assert_speculated(delta, min_accepted=5)


def test_a_sampled_structured_output_stays_valid(speculating: LLM) -> None:
    """Sampling with drafts: a rejected draft rolls the grammar back, so every output still
    parses (a matcher left a draft ahead would refuse the next token or end early)."""
    constraint = OutputConstraint.json_schema(CHOICES, "response_format")
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=120, structured_output=constraint)
        for seed in range(6)
    ]
    outputs, delta = generate_counted(speculating, [repeating_prompt(95)] * 6, params)
    for out in outputs:
        assert out.finish_reason == "stop", out
        assert len(json.loads(out.text)) == 8
    assert_speculated(delta, min_accepted=5)
    assert delta.num_accepted_tokens < delta.num_draft_tokens  # some were rejected


def generate_within(
    llm: LLM, prompt: list[int], params: SamplingParams, max_steps: int
) -> dict[int, list[int]] | None:
    """Each choice's tokens, or None if the engine had not finished after ``max_steps``."""
    engine = llm.engine
    engine.add(engine.make_request("bounded", prompt, params))
    tokens: dict[int, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return tokens
        for delta in engine.step():
            tokens.setdefault(delta.index, []).extend(delta.new_token_ids)
    return None


def test_n_choices_when_the_last_prompt_chunk_is_one_token(checkpoint: Path) -> None:
    """A 16-token budget prefills a 33-token prompt in chunks of 16, 16 and 1."""
    options: dict[str, Any] = {"max_num_batched_tokens": 16, "enable_prefix_caching": False}
    plain = make_llm(checkpoint, speculative=False, **options)
    speculating = make_llm(checkpoint, speculative=True, **options)
    prompt = repeating_prompt(101, segment=11, times=3)[:33]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=3)
    reference = generate_within(plain, prompt, params, max_steps=100)
    assert reference is not None
    script(speculating, {tuple(prompt): reference[0]})  # drafts from the first decode on
    before = counts(speculating)
    assert generate_within(speculating, prompt, params, max_steps=100) == reference
    assert counts(speculating).num_accepted_tokens > before.num_accepted_tokens


def test_the_model_length_ends_a_run_where_it_would(checkpoint: Path) -> None:
    """A 64-token context: drafts are capped by what is left of it, and the last one kept
    ends the request there."""
    plain = make_llm(checkpoint, speculative=False, max_model_len=64)
    llm = make_llm(checkpoint, speculative=True, max_model_len=64)
    prompts = [random_prompt(40 + i, seed=110 + i) for i in range(4)]
    params = replace(GREEDY, max_tokens=None)
    ref = plain.generate(prompts, params)
    script(llm, {tuple(p): o.token_ids for p, o in zip(prompts, ref, strict=True)})
    spec, delta = generate_counted(llm, prompts, params)
    assert_same_outputs(spec, ref)
    assert [len(p) + len(o.token_ids) for p, o in zip(prompts, spec, strict=True)] == [64] * 4
    assert all(o.finish_reason == "length" for o in spec)
    assert_speculated(delta, min_accepted=20)
