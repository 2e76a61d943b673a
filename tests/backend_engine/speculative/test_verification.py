from __future__ import annotations

import pytest
import torch

from backend_engine.speculative.verification import (
    VerifiedTokens,
    accept_greedy,
    verify_greedy,
    verify_greedy_batch,
    verify_sampled,
)

VOCAB = 6
NUM_DRAFTS = 2
NUM_TRIALS = 20_000
SIGNIFICANCE = 0.001  # fixed seeds: a pass or a failure is the same on every run


def one_hot_logits(token_ids: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(token_ids), VOCAB)
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 5.0
    return logits


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test of counts against probabilities; the p-value from the chi-square
    distribution's survival function, the regularized upper incomplete gamma function."""
    observed = observed.double().flatten()
    expected = expected_probs.double().flatten() * observed.sum()
    assert float(expected.min()) >= 5.0, "too few draws for the chi-square approximation"
    statistic = ((observed - expected) ** 2 / expected).sum()
    degrees_of_freedom = torch.tensor(observed.numel() - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(degrees_of_freedom / 2, statistic / 2))


def random_distributions(num_rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(num_rows, VOCAB, generator=generator) * 0.8, dim=-1)


def first_two_tokens(
    target: torch.Tensor,  # [num_drafts + 2, VOCAB]: the target's p at output positions 0..
    draft: torch.Tensor | None,  # [num_drafts + 1, VOCAB] the drafter's q, or None: n-gram
    fixed_drafts: list[int],  # the n-gram's drafts at positions 0..num_drafts (when no q)
    num_drafts: int,
    seed: int,
) -> torch.Tensor:
    """[NUM_TRIALS, 2]: the first two tokens a speculating generation emits, step after step,
    for a target whose distribution at each position is fixed (so their joint is p_0 x p_1).
    A step that emits only one token is followed by a step from position 1. With one draft
    the second token is often the bonus; with two, a kept draft or a correction."""
    generator = torch.Generator().manual_seed(seed)
    draft_generator = torch.Generator().manual_seed(seed + 1)
    if draft is not None:  # every trial's drafts for both possible steps, drawn up front
        drawn = torch.stack(
            [torch.multinomial(row, NUM_TRIALS, True, generator=draft_generator) for row in draft]
        ).T.tolist()
    emitted = torch.empty(NUM_TRIALS, 2, dtype=torch.long)
    for trial in range(NUM_TRIALS):
        tokens: list[int] = []
        while len(tokens) < 2:
            start = len(tokens)
            if draft is None:
                drafts = fixed_drafts[start : start + num_drafts]
                draft_rows = None
            else:
                drafts = drawn[trial][start : start + num_drafts]
                draft_rows = draft[start : start + num_drafts]
            verified = verify_sampled(
                drafts, target[start : start + num_drafts + 1], draft_rows, generator
            )
            assert len(verified.token_ids) == verified.num_accepted_drafts + 1
            assert list(verified.token_ids[:-1]) == drafts[: verified.num_accepted_drafts]
            tokens.extend(verified.token_ids)
        emitted[trial] = torch.tensor(tokens[:2])
    return emitted


def assert_follows_the_target(emitted: torch.Tensor, target: torch.Tensor) -> None:
    first = torch.bincount(emitted[:, 0], minlength=VOCAB)
    assert chi_square_p_value(first, target[0]) > SIGNIFICANCE
    joint = torch.bincount(emitted[:, 0] * VOCAB + emitted[:, 1], minlength=VOCAB * VOCAB)
    assert chi_square_p_value(joint, torch.outer(target[0], target[1])) > SIGNIFICANCE


# --- greedy


def test_greedy_accepts_every_agreeing_draft_and_adds_the_bonus() -> None:
    assert verify_greedy([3, 1], one_hot_logits([3, 1, 4])) == VerifiedTokens((3, 1, 4), 2)


def test_greedy_stops_at_the_first_disagreement_with_the_target_token() -> None:
    assert verify_greedy([3, 2, 5], one_hot_logits([3, 1, 5, 0])) == VerifiedTokens((3, 1), 1)
    assert verify_greedy([2, 1], one_hot_logits([3, 1, 4])) == VerifiedTokens((3,), 0)


def test_greedy_without_drafts_is_a_plain_decode() -> None:
    assert verify_greedy([], one_hot_logits([4])) == VerifiedTokens((4,), 0)


def test_greedy_batch_splits_rows_by_each_sequences_drafts() -> None:
    logits = one_hot_logits([3, 1, 4, 0, 5, 5, 2, 1])  # rows 3 1 4 | 0 | 5 5 2 1
    assert verify_greedy_batch([[3, 1], [], [5, 2, 2]], logits) == [
        VerifiedTokens((3, 1, 4), 2),
        VerifiedTokens((0,), 0),
        VerifiedTokens((5, 5), 1),
    ]


def test_greedy_rejects_rows_that_do_not_fit_the_drafts() -> None:
    with pytest.raises(ValueError, match="need 3 target rows"):
        verify_greedy([1, 2], one_hot_logits([1, 2]))
    with pytest.raises(ValueError, match="2 drafts need 3 target tokens"):
        accept_greedy([1, 2], [1, 2])


# --- sampling: the emitted tokens follow the target's distribution


@pytest.mark.parametrize("num_drafts", [1, 2])
def test_draft_model_verification_emits_the_targets_distribution(num_drafts: int) -> None:
    target = random_distributions(num_drafts + 2, seed=1)
    draft = random_distributions(num_drafts + 1, seed=2)
    emitted = first_two_tokens(target, draft, [], num_drafts, seed=3)
    assert_follows_the_target(emitted, target)


def test_a_draft_distribution_with_zeros_where_the_target_has_mass() -> None:
    target = random_distributions(NUM_DRAFTS + 2, seed=4)
    draft = random_distributions(NUM_DRAFTS + 1, seed=5)
    draft[:, :3] = 0.0  # tokens 0-2 are never drafted: only the residual can emit them
    draft /= draft.sum(dim=-1, keepdim=True)
    emitted = first_two_tokens(target, draft, [], NUM_DRAFTS, seed=6)
    assert_follows_the_target(emitted, target)


@pytest.mark.parametrize("num_drafts", [1, 2])
def test_n_gram_verification_emits_the_targets_distribution(num_drafts: int) -> None:
    target = random_distributions(num_drafts + 2, seed=7)
    # Likely and unlikely drafts alike: drafts are not drawn from anything.
    likely = target.argmax(dim=-1).tolist()
    unlikely = target.argmin(dim=-1).tolist()
    fixed_drafts = [likely[0], unlikely[1], likely[2]][: num_drafts + 1]
    emitted = first_two_tokens(target, None, fixed_drafts, num_drafts, seed=8)
    assert_follows_the_target(emitted, target)


def test_the_chi_square_check_can_tell_the_draft_from_the_target() -> None:
    # Emitting drafts unverified would follow q, not p: the same check must reject that.
    target = random_distributions(1, seed=1)[0]
    draft = random_distributions(1, seed=2)[0]
    generator = torch.Generator().manual_seed(9)
    unverified = torch.multinomial(draft, NUM_TRIALS, True, generator=generator)
    assert chi_square_p_value(torch.bincount(unverified, minlength=VOCAB), target) < SIGNIFICANCE


# --- sampling: edge cases and seeds


@pytest.mark.parametrize(
    ("drafts", "num_accepted"), [([4, 4], 2), ([4, 1], 1), ([0, 4], 0), ([2, 3], 0)]
)
@pytest.mark.parametrize("is_n_gram", [False, True])
def test_a_one_hot_target_always_emits_its_token(
    drafts: list[int], num_accepted: int, is_n_gram: bool
) -> None:
    target = torch.zeros(NUM_DRAFTS + 1, VOCAB)
    target[:, 4] = 1.0
    draft = None if is_n_gram else random_distributions(NUM_DRAFTS, seed=10)
    generator = torch.Generator().manual_seed(11)
    for _ in range(20):
        verified = verify_sampled(drafts, target, draft, generator)
        assert verified == VerifiedTokens((4,) * (num_accepted + 1), num_accepted)


def test_an_n_gram_draft_the_target_rules_out_is_never_kept() -> None:
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0], [0.2] * 5 + [0.0]])
    generator = torch.Generator().manual_seed(12)
    emitted = set()
    for _ in range(200):
        verified = verify_sampled([0], target, None, generator)
        assert verified.num_accepted_drafts == 0
        emitted.add(verified.token_ids)
    assert emitted == {(1,), (2,)}  # the residual is p itself: 0 had no mass to remove


def test_a_rejected_n_gram_draft_is_replaced_from_the_rest_of_the_target() -> None:
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0], [0.2] * 5 + [0.0]])
    generator = torch.Generator().manual_seed(12)
    num_kept = 0
    for _ in range(200):
        verified = verify_sampled([1], target, None, generator)
        if verified.num_accepted_drafts == 1:
            num_kept += 1
            assert verified.token_ids[0] == 1
            assert verified.token_ids[1] != 5  # the bonus, from the second row
        else:  # p without token 1 leaves only token 2
            assert verified.token_ids == (2,)
    assert 60 < num_kept < 140  # kept with probability 1/2


def test_a_draft_the_drafter_gave_no_probability_is_kept_if_the_target_allows_it() -> None:
    target = torch.tensor([[0.1, 0.9, 0.0, 0.0, 0.0, 0.0], [1.0] + [0.0] * 5])
    draft = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    generator = torch.Generator().manual_seed(13)
    assert verify_sampled([1], target, draft, generator) == VerifiedTokens((1, 0), 1)
    assert verify_sampled([2], target, draft, generator).num_accepted_drafts == 0


def test_the_same_seed_gives_the_same_tokens() -> None:
    target = random_distributions(4, seed=14)
    draft = random_distributions(3, seed=15)

    def run(seed: int) -> list[VerifiedTokens]:
        generator = torch.Generator().manual_seed(seed)
        return [verify_sampled([1, 2, 3], target, draft, generator) for _ in range(50)] + [
            verify_sampled([1, 2, 3], target, None, generator) for _ in range(50)
        ]

    assert run(16) == run(16)
    assert run(16) != run(17)


def test_sampling_without_drafts_draws_from_the_first_row() -> None:
    target = torch.zeros(1, VOCAB)
    target[0, 5] = 1.0
    generator = torch.Generator().manual_seed(18)
    assert verify_sampled([], target, None, generator) == VerifiedTokens((5,), 0)


@pytest.mark.parametrize(
    ("drafts", "target_shape", "draft_shape", "message"),
    [
        ([1, 2], (2, VOCAB), None, "2 drafts need 3 target rows"),
        ([1, 2], (3, VOCAB), (3, VOCAB), r"draft_probs must have shape \(2, 6\)"),
        ([1, VOCAB], (3, VOCAB), None, r"draft tokens \[6\] are outside the vocabulary of 6"),
    ],
)
def test_sampling_rejects_inputs_that_do_not_fit(
    drafts: list[int],
    target_shape: tuple[int, int],
    draft_shape: tuple[int, int] | None,
    message: str,
) -> None:
    target = torch.full(target_shape, 1 / VOCAB)
    draft = None if draft_shape is None else torch.full(draft_shape, 1 / VOCAB)
    with pytest.raises(ValueError, match=message):
        verify_sampled(drafts, target, draft, torch.Generator())
