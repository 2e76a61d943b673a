"""The draft-model proposer: its drafts are its greedy continuation, the target's output is
what it is without speculation, and its cache is paged, reused and freed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from backend_engine import LLM, SamplingParams
from backend_engine.config import EngineConfig
from backend_engine.core.request import Request
from backend_engine.speculative.draft_model import DraftModelProposer

BLOCK_SIZE = 16
K = 4
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=77, max_tokens=24, ignore_eos=True)


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [random_prompt(37, seed=1), random_prompt(20, seed=2), random_prompt(5, seed=3)]


def make_llm(model: Path, drafter: Path | None = None, **options: object) -> LLM:
    # Drafts free unless a test says otherwise: k follows acceptance alone (the drafter here
    # is as big as the target, whose drafts the measured cost would rightly never pay for).
    speculative: dict[str, object] = (
        {
            "speculative_proposer": "draft",
            "speculative_draft_model": str(drafter),
            "speculative_draft_cost": 0.0,
        }
        if drafter is not None
        else {}
    )
    return LLM(
        model=str(model),
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_speculative_tokens=K,
        **{**speculative, **options},  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def target(demo_checkpoint: Callable[..., Path]) -> Path:
    return demo_checkpoint(size="tiny")


@pytest.fixture(scope="module")
def plain(target: Path) -> LLM:
    return make_llm(target)


def proposer_of(llm: LLM) -> DraftModelProposer:
    speculator = llm.engine.speculator
    assert speculator is not None
    assert isinstance(speculator.proposer, DraftModelProposer)
    return speculator.proposer


def greedy_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, params)]


def test_the_target_as_its_own_drafter_keeps_every_draft(plain: LLM, target: Path) -> None:
    llm = make_llm(target, drafter=target)
    expected = greedy_tokens(plain, PROMPTS, GREEDY)
    for prompt, tokens in zip(PROMPTS, expected, strict=True):  # one stream, then a batch
        assert greedy_tokens(llm, [prompt], GREEDY) == [tokens]
    assert greedy_tokens(llm, PROMPTS, GREEDY) == expected
    counts = llm.engine.stats().speculative["draft"]
    assert counts.num_draft_tokens > len(PROMPTS) * 2 * K
    assert counts.num_accepted_tokens == counts.num_draft_tokens
    assert proposer_of(llm).num_used_blocks == 0  # every request's blocks freed at its end


def test_another_drafter_changes_no_token_and_keeps_fewer(
    plain: LLM, target: Path, demo_checkpoint: Callable[..., Path]
) -> None:
    llm = make_llm(target, drafter=demo_checkpoint(size="tiny", seed=1))
    assert greedy_tokens(llm, PROMPTS, GREEDY) == greedy_tokens(plain, PROMPTS, GREEDY)
    counts = llm.engine.stats().speculative["draft"]
    assert counts.num_draft_tokens > 0
    assert counts.num_accepted_tokens < counts.num_draft_tokens


def test_seeded_sampling_is_reproducible(target: Path) -> None:
    llm = make_llm(target, drafter=target)
    first = greedy_tokens(llm, PROMPTS, SEEDED)
    assert greedy_tokens(llm, PROMPTS, SEEDED) == first
    assert greedy_tokens(llm, PROMPTS, replace(SEEDED, seed=78)) != first
    assert llm.engine.stats().speculative["draft"].num_accepted_tokens > 0


def test_the_measured_cost_of_a_draft_includes_the_drafters_pass(target: Path) -> None:
    # The target drafting for itself: a draft costs its row in the target's step plus a
    # whole pass of the same model, about one step more; the scratch blocks are given back.
    llm = make_llm(target, drafter=target, speculative_draft_cost=None)
    speculator = llm.engine.speculator
    assert speculator is not None
    assert speculator.settings.draft_cost > 0.3
    proposer = proposer_of(llm)
    assert proposer.num_used_blocks == 0
    assert proposer.measure_draft_seconds() > 0.0
    assert proposer.num_used_blocks == 0


def test_a_drafter_with_another_vocabulary_is_refused(
    target: Path, demo_checkpoint: Callable[..., Path]
) -> None:
    with pytest.raises(ValueError, match="vocabulary of 4096 tokens and the target one of 512"):
        make_llm(target, drafter=demo_checkpoint(size="small"))


def test_blocks_are_held_while_a_request_runs_and_freed_when_it_ends(target: Path) -> None:
    llm = make_llm(target, drafter=target)
    engine, proposer = llm.engine, proposer_of(llm)
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[1], GREEDY)
    for _ in range(3):
        engine.step()
    # The first step prefilled each prompt and chose a token, the second kept K drafts and the
    # target's token, the third drafted after 37 + 1 + 5 tokens ("a", 3 blocks for K - 1 more)
    # and after 20 + 1 + 5 ("b", 2 blocks).
    assert proposer.num_used_blocks == 5
    engine.abort(["b"])
    assert proposer.num_used_blocks == 3
    while engine.has_unfinished():
        engine.step()
    assert proposer.num_used_blocks == 0


def drafter_config(drafter: Path, **options: object) -> EngineConfig:
    return EngineConfig(
        model=str(drafter),
        dtype="float32",
        block_size=BLOCK_SIZE,
        speculative_proposer="draft",
        speculative_draft_model=str(drafter),
        **options,  # type: ignore[arg-type]
    )


def request(token_ids: list[int], max_tokens: int = 100) -> Request:
    return Request("r", token_ids, GREEDY, max_tokens=max_tokens, arrival_seq=0)


def test_drafts_are_the_drafters_greedy_continuation_as_the_sequence_grows(
    plain: LLM, target: Path
) -> None:
    proposer = DraftModelProposer(drafter_config(target), 512, num_blocks=16)
    sequence = request(list(PROMPTS[0]))
    first = proposer.propose(sequence, K)
    assert list(first) == greedy_tokens(plain, [PROMPTS[0]], replace(GREEDY, max_tokens=K))[0]
    # The target kept one draft and chose another token, then two more without drafts: the
    # cache keeps the first draft's KV (not the second's) and computes the rest.
    sequence.all_token_ids += [first[0], (first[1] + 1) % 500, 11, 12]
    second = proposer.propose(sequence, K)
    expected = greedy_tokens(plain, [sequence.all_token_ids], replace(GREEDY, max_tokens=K))[0]
    assert list(second) == expected
    # Every draft kept and one more token: the last draft and that token are new.
    sequence.all_token_ids += [*second, 7]
    third = proposer.propose(sequence, 2)
    expected = greedy_tokens(plain, [sequence.all_token_ids], replace(GREEDY, max_tokens=2))[0]
    assert list(third) == expected


def test_a_batch_drafts_as_each_sequence_alone(target: Path) -> None:
    alone = DraftModelProposer(drafter_config(target), 512, num_blocks=32)
    together = DraftModelProposer(drafter_config(target), 512, num_blocks=32)
    requests = [
        Request(f"r{i}", list(p), GREEDY, max_tokens=100, arrival_seq=i)
        for i, p in enumerate(PROMPTS)
    ]
    expected = [alone.propose(r, K - i) for i, r in enumerate(requests)]
    assert together.propose_batch([(r, K - i) for i, r in enumerate(requests)]) == expected
    assert [len(drafts) for drafts in expected] == [K, K - 1, K - 2]


def test_no_room_or_no_use_proposes_nothing(target: Path) -> None:
    proposer = DraftModelProposer(drafter_config(target), 512, num_blocks=2)
    assert proposer.propose(request(random_prompt(40, seed=4)), K) == ()  # needs 3 blocks
    assert proposer.num_used_blocks == 0
    short = request(random_prompt(10, seed=5), max_tokens=3)
    assert len(proposer.propose(short, K)) == 2  # a third draft could never be kept
    assert proposer.num_used_blocks == 1
    proposer.forget("r")
    assert proposer.num_used_blocks == 0
