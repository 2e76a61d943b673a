from __future__ import annotations

import random

import pytest

from backend_engine.speculative.ngram_proposer import NgramIndex


def brute_force_proposal(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[int, ...]:
    """The rule read literally: for n from max_n down, the latest earlier occurrence."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):  # an occurrence ending before the suffix's end
            if tokens[end - n : end] == suffix:
                return tuple(tokens[end : end + k])
    return ()


def test_copies_what_followed_the_match_in_the_prompt() -> None:
    prompt = [7, 8, 9, 10, 11, 12, 13]
    index = NgramIndex(min_n=2, max_n=3, token_ids=prompt)
    index.extend([8, 9])  # the answer starts quoting the prompt
    assert index.propose(3) == (10, 11, 12)
    index.append(10)  # an accepted token moves the match along
    assert index.propose(3) == (11, 12, 13)


def test_prefers_the_longest_n_gram() -> None:
    # "5 6" last followed by 1 (positions 5-6), but "4 5 6" followed by 2 (positions 1-3).
    tokens = [4, 5, 6, 2, 3, 5, 6, 1, 0, 4, 5, 6]
    assert NgramIndex(min_n=1, max_n=3, token_ids=tokens).propose(2) == (2, 3)
    assert NgramIndex(min_n=1, max_n=2, token_ids=tokens).propose(2) == (1, 0)


def test_takes_the_most_recent_earlier_occurrence() -> None:
    tokens = [1, 2, 30, 31, 1, 2, 40, 41, 9, 1, 2]
    assert NgramIndex(min_n=2, max_n=2, token_ids=tokens).propose(2) == (40, 41)


def test_proposes_fewer_than_k_when_the_sequence_ends() -> None:
    # "3 4" occurred at positions 1-2 and continued with 5, then the sequence ends after 3 4.
    index = NgramIndex(min_n=2, max_n=2, token_ids=[9, 3, 4, 5, 3, 4])
    assert index.propose(10) == (5, 3, 4)
    # An overlapping repeat: "7 7" last continued at the final position, one token left.
    assert NgramIndex(min_n=2, max_n=2, token_ids=[7, 7, 7]).propose(4) == (7,)


def test_no_proposal_when_nothing_matches() -> None:
    assert NgramIndex(min_n=1, max_n=3, token_ids=[1, 2, 3, 4]).propose(4) == ()
    assert NgramIndex(min_n=1, max_n=3).propose(4) == ()
    # The suffix itself is never its own match: "2 3" occurs once, at the end.
    assert NgramIndex(min_n=2, max_n=2, token_ids=[2, 1, 3, 2, 3]).propose(4) == ()
    # A 1-gram match exists (3 after 3), but min_n = 2 forbids using it.
    assert NgramIndex(min_n=2, max_n=3, token_ids=[3, 5, 3]).propose(2) == ()
    assert NgramIndex(min_n=1, max_n=3, token_ids=[3, 5, 3]).propose(2) == (5, 3)


def test_k_zero_proposes_nothing() -> None:
    assert NgramIndex(min_n=1, max_n=2, token_ids=[1, 2, 1]).propose(0) == ()


@pytest.mark.parametrize(
    ("min_n", "max_n", "message"),
    [(0, 3, "min_n must be at least 1"), (3, 2, r"max_n \(2\) must be at least min_n \(3\)")],
)
def test_rejects_bad_n_bounds(min_n: int, max_n: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NgramIndex(min_n=min_n, max_n=max_n)


def test_rejects_negative_k_and_bad_truncation() -> None:
    index = NgramIndex(min_n=1, max_n=2, token_ids=[1, 2])
    with pytest.raises(ValueError, match="k must be at least 0"):
        index.propose(-1)
    with pytest.raises(ValueError, match="between 0 and 2"):
        index.truncate(3)
    with pytest.raises(ValueError, match="between 0 and 2"):
        index.truncate(-1)


def test_truncation_forgets_the_rolled_back_tokens() -> None:
    index = NgramIndex(min_n=1, max_n=3, token_ids=[1, 2, 3, 9, 1, 2])
    assert index.propose(2) == (3, 9)
    index.extend([5, 6, 1, 2])  # now "1 2" last continued with 5
    assert index.propose(2) == (5, 6)
    index.truncate(6)
    assert index.num_tokens == 6
    assert index.propose(2) == (3, 9)
    index.extend([8, 8])  # a different continuation after the rollback
    index.extend([1, 2])
    assert index.propose(2) == (8, 8)


def test_truncating_to_nothing_leaves_an_empty_index() -> None:
    index = NgramIndex(min_n=1, max_n=2, token_ids=[1, 2, 1, 2])
    index.truncate(0)
    assert index.num_tokens == 0
    assert index.propose(3) == ()
    index.extend([4, 4])
    assert index.propose(3) == (4,)


def test_matches_the_literal_rule_through_appends_and_rollbacks() -> None:
    rng = random.Random(29)
    index = NgramIndex(min_n=2, max_n=4)
    tokens: list[int] = []
    for _ in range(3000):
        if tokens and rng.random() < 0.15:
            keep = rng.randrange(max(0, len(tokens) - 6), len(tokens))
            index.truncate(keep)
            del tokens[keep:]
        else:
            token = rng.randrange(4)  # a tiny vocabulary makes repeats, and so matches, common
            index.append(token)
            tokens.append(token)
        k = rng.randrange(6)
        assert index.num_tokens == len(tokens)
        assert index.propose(k) == brute_force_proposal(tokens, 2, 4, k)
