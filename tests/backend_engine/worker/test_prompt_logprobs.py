"""Prompt logprobs from a chunk's hidden states: position j - 1 predicts prompt token j, the
first token has None, chunks continue each other, and a recompute reports nothing twice."""

from __future__ import annotations

import pytest
import torch

from backend_engine.core.scheduler import ScheduledRequest
from backend_engine.sampling_params import SamplingParams
from backend_engine.worker.prompt_logprobs import (
    MAX_POSITIONS_PER_SLICE,
    chunk_prompt_logprobs,
    owes_prompt_logprobs,
)

VOCAB, HIDDEN = 50, 8
NUM_TOP = 2


@pytest.fixture(scope="module")
def head() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(HIDDEN, VOCAB)


def chunk(
    tokens: list[int], start: int, num: int, num_prompt: int, reported: int, k: int = NUM_TOP
) -> ScheduledRequest:
    return ScheduledRequest(
        request_id="r",
        token_ids=tokens[start : start + num],
        start_position=start,
        block_table=[],
        sampling_params=SamplingParams(prompt_logprobs=k),
        do_sample=start + num == len(tokens),
        is_decode=num == 1,
        all_token_ids=tokens,
        num_prompt_tokens=num_prompt,
        num_reported_prompt_logprobs=reported,
    )


def expected_entries(head: torch.nn.Linear, hidden: torch.Tensor, tokens: list[int]) -> list:
    logprobs = torch.log_softmax(head(hidden), -1)
    entries: list = [None]
    for j in range(1, len(tokens)):
        top_ids = logprobs[j - 1].topk(NUM_TOP).indices
        entries.append((tokens[j], float(logprobs[j - 1, tokens[j]]), top_ids.tolist()))
    return entries


def as_tuples(entries: list) -> list:
    return [None if e is None else (e.token_id, e.logprob, [t for t, _ in e.top]) for e in entries]


def close(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
            continue
        assert g[0] == w[0]
        assert g[1] == pytest.approx(w[1], abs=1e-5)
        assert g[2] == w[2]


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def test_a_whole_prompt_has_one_entry_per_token_the_first_none(head):
    tokens = prompt(10)
    hidden = torch.randn(10, HIDDEN)
    entries = chunk_prompt_logprobs(head, hidden, chunk(tokens, 0, 10, 10, reported=0))
    # The last position predicts the first output token: not a prompt logprob.
    close(as_tuples(entries), expected_entries(head, hidden, tokens))


@torch.no_grad()
def test_chunks_continue_each_other(head):
    tokens = prompt(12, seed=1)
    hidden = torch.randn(12, HIDDEN)
    got: list = []
    for start, num in ((0, 1), (1, 4), (5, 7)):
        item = chunk(tokens, start, num, 12, reported=len(got))
        got.extend(chunk_prompt_logprobs(head, hidden[start : start + num], item))
    close(as_tuples(got), expected_entries(head, hidden, tokens))


@torch.no_grad()
def test_a_recompute_reports_only_what_is_still_owed(head):
    tokens = [*prompt(9, seed=2), 3, 4]  # a prompt of 9, then two output tokens
    hidden = torch.randn(11, HIDDEN)
    want = expected_entries(head, hidden[:9], tokens[:9])
    first = chunk_prompt_logprobs(head, hidden[:4], chunk(tokens, 0, 4, 9, reported=0))
    assert len(first) == 5  # None, then tokens 1..4
    # Preempted: the recompute runs from position 0 over prompt and output alike.
    again = chunk_prompt_logprobs(head, hidden, chunk(tokens, 0, 11, 9, reported=5))
    close(as_tuples(first + again), want)
    done = chunk(tokens, 0, 11, 9, reported=9)
    assert not owes_prompt_logprobs(done)


@torch.no_grad()
def test_long_chunks_are_computed_in_slices(head):
    n = 2 * MAX_POSITIONS_PER_SLICE + 7
    tokens = prompt(n, seed=3)
    hidden = torch.randn(n, HIDDEN)
    calls: list[int] = []

    def compute_logits(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return head(rows)

    entries = chunk_prompt_logprobs(compute_logits, hidden, chunk(tokens, 0, n, n, reported=0))
    close(as_tuples(entries), expected_entries(head, hidden, tokens))
    assert max(calls) <= MAX_POSITIONS_PER_SLICE
    assert sum(calls) == n - 1


def test_only_requests_that_ask_and_are_owed_compute_them():
    tokens = prompt(5)
    assert owes_prompt_logprobs(chunk(tokens, 0, 5, 5, reported=0, k=0))
    assert not owes_prompt_logprobs(chunk(tokens, 0, 5, 5, reported=5))
    plain = ScheduledRequest("p", tokens, 0, [], SamplingParams(), True, False, None)
    assert not owes_prompt_logprobs(plain)


@torch.no_grad()
def test_without_alternatives_each_entry_has_its_token_only(head):
    tokens = prompt(4, seed=4)
    hidden = torch.randn(4, HIDDEN)
    entries = chunk_prompt_logprobs(head, hidden, chunk(tokens, 0, 4, 4, reported=0, k=0))
    assert entries[0] is None
    assert [e.top for e in entries[1:] if e is not None] == [(), (), ()]
