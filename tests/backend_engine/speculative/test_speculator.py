"""The engine loop's speculator: which sequences get drafts, how many, what verification
teaches it, the crossover, and a proposer's failure pinned on its own request."""

from __future__ import annotations

from dataclasses import replace

import pytest

from backend_engine.config import EngineConfig
from backend_engine.core.request import Request
from backend_engine.core.scheduler_output import ScheduledRequest, describe
from backend_engine.outputs import SpeculativeCounts
from backend_engine.sampling_params import SamplingParams
from backend_engine.speculative.adaptive_k import AdaptiveKSettings
from backend_engine.speculative.speculator import NgramProposer, Speculator, make_speculator

# Drafts at 70% of a step, so k depends on acceptance: at the prior 0.9, two drafts pay best.
SETTINGS = AdaptiveKSettings(
    max_k=4,
    crossover_batch_size=4,
    draft_cost=0.7,
    initial_acceptance=0.9,
    prior_weight=1.0,
    ema_weight=0.5,
)


class CountingProposer:
    """Proposes 50, 51, ... (k of them); remembers who asked for how many, and who ended."""

    name = "counting"

    def __init__(self, failing: frozenset[str] = frozenset()) -> None:
        self.asked: list[tuple[str, int]] = []
        self.forgotten: list[str] = []
        self.failing = failing

    def propose(self, request: Request, k: int) -> tuple[int, ...]:
        self.asked.append((request.request_id, k))
        if request.request_id in self.failing:
            raise ValueError(f"cannot propose for {request.request_id}")
        return tuple(range(50, 50 + k + 2))  # more than asked: the speculator keeps k

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def decoding_request(rid: str, tokens: list[int] | None = None) -> Request:
    """A request with one token left to compute (its last, just sampled)."""
    tokens = tokens or [1, 2, 3, 4]
    request = Request(rid, tokens[:-1], SamplingParams(), max_tokens=64, arrival_seq=0)
    request.all_token_ids.append(tokens[-1])
    request.num_computed_tokens = request.num_tokens - 1
    return request


def scheduled(request: Request, num_drafts: int) -> ScheduledRequest:
    """The chunk the scheduler makes of its last token and its first ``num_drafts`` drafts."""
    return describe(request, 1 + num_drafts, [])


def test_only_decoding_sequences_get_drafts_k_of_them() -> None:
    proposer = CountingProposer()
    speculator = Speculator(proposer, SETTINGS)
    decoding = decoding_request("a")
    prefilling = Request("b", [1, 2, 3], SamplingParams(), max_tokens=8, arrival_seq=1)
    prefilling.draft_token_ids = (9,)  # stale: cleared
    assert speculator.propose([decoding, prefilling]) == {}
    assert decoding.draft_token_ids == (50, 51)  # k = 2 at the prior
    assert prefilling.draft_token_ids == ()
    assert proposer.asked == [("a", 2)]


def test_k_follows_what_verification_kept() -> None:
    speculator = Speculator(CountingProposer(), SETTINGS)
    request = decoding_request("a")
    speculator.propose([request])
    speculator.record([scheduled(request, 2)], {"a": 2})  # all kept (1.45 / 1.5): all 4 pay
    speculator.propose([request])
    assert request.draft_token_ids == (50, 51, 52, 53)
    speculator.record([scheduled(request, 4)], {"a": 3})  # 2.225 / 2.75 = 0.81: 1 pays
    speculator.propose([request])
    assert request.draft_token_ids == (50,)
    speculator.record([scheduled(request, 1)], {"a": 0})  # 1.11 / 1.875 = 0.59: none pays
    speculator.propose([request])
    assert request.draft_token_ids == ()


def test_record_counts_the_drafts_scored_and_kept() -> None:
    speculator = Speculator(CountingProposer(), SETTINGS)
    a, b, c = decoding_request("a"), decoding_request("b"), decoding_request("c")
    speculator.propose([a, b, c])
    speculator.record(
        [scheduled(a, 2), scheduled(b, 1), scheduled(c, 0)],  # c: no room for its drafts
        {"a": 1, "b": 1, "c": 0},
    )
    assert speculator.counts == SpeculativeCounts(
        num_verified_chunks=2, num_draft_tokens=3, num_accepted_tokens=2
    )
    speculator.propose([a])
    speculator.record([scheduled(a, 2)], {})  # a failed this step: nothing was verified
    assert speculator.counts.num_draft_tokens == 3
    assert speculator.counts.acceptance_rate == pytest.approx(2 / 3)
    assert speculator.counts.accepted_tokens_per_chunk == pytest.approx(1.0)


def test_no_drafts_at_or_past_the_crossover() -> None:
    proposer = CountingProposer()
    speculator = Speculator(proposer, SETTINGS)
    requests = [decoding_request(f"r{i}") for i in range(4)]  # the crossover: 4
    assert speculator.propose(requests) == {}
    assert all(r.draft_token_ids == () for r in requests)
    assert proposer.asked == []
    speculator.propose(requests[:3])
    assert [r.draft_token_ids for r in requests[:3]] == [(50, 51)] * 3


def test_a_proposer_that_raises_fails_only_its_request() -> None:
    speculator = Speculator(CountingProposer(failing=frozenset({"b"})), SETTINGS)
    a, b, c = decoding_request("a"), decoding_request("b"), decoding_request("c")
    b.draft_token_ids = (9,)
    failures = speculator.propose([a, b, c])
    assert list(failures) == ["b"]
    assert isinstance(failures["b"], ValueError)
    assert (a.draft_token_ids, b.draft_token_ids, c.draft_token_ids) == ((50, 51), (), (50, 51))


def test_forget_drops_the_state_and_tells_the_proposer() -> None:
    proposer = CountingProposer()
    speculator = Speculator(proposer, SETTINGS)
    request = decoding_request("a")
    speculator.propose([request])
    speculator.record([scheduled(request, 2)], {"a": 2})  # k would be 4 next
    speculator.forget("a")
    assert proposer.forgotten == ["a"]
    speculator.propose([request])  # the same id again starts afresh
    assert request.draft_token_ids == (50, 51)


def test_the_ngram_proposer_reads_the_sequence_and_starts_over_when_it_shrinks() -> None:
    proposer = NgramProposer(min_n=2, max_n=3)
    request = decoding_request("a", [5, 6, 7, 8, 5, 6])
    assert proposer.propose(request, 3) == (7, 8, 5)
    request.all_token_ids.append(7)
    assert proposer.propose(request, 2) == (8, 5)
    del request.all_token_ids[-3:]  # lost tokens (truncated): the index is rebuilt
    request.all_token_ids += [9, 7]
    assert proposer.propose(request, 2) == ()
    proposer.forget("a")
    assert proposer.propose(request, 2) == ()


def test_make_speculator_follows_the_config() -> None:
    assert make_speculator(EngineConfig(model="m"), 512, 64) is None
    config = EngineConfig(
        model="m",
        speculative_proposer="ngram",
        num_speculative_tokens=6,
        speculative_crossover_batch_size=3,
        speculative_ngram_min=1,
        speculative_ngram_max=5,
    )
    speculator = make_speculator(config, 512, 64)
    assert speculator is not None
    assert speculator.proposer.name == "ngram"
    assert isinstance(speculator.proposer, NgramProposer)
    assert (speculator.proposer.min_n, speculator.proposer.max_n) == (1, 5)
    assert (speculator.settings.max_k, speculator.settings.crossover_batch_size) == (6, 3)
    with pytest.raises(ValueError, match="speculative_proposer"):
        replace(config, speculative_proposer="medusa")
