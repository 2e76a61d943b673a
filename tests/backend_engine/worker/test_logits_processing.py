"""The logits stage against references written from each formula: OpenAI's for presence and
frequency, transformers' own ``RepetitionPenaltyLogitsProcessor`` for repetition."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from backend_engine.sampling_params import SamplingParams
from backend_engine.worker.logits_processing import apply_logits_stage

VOCAB = 64


@dataclass(frozen=True)
class Row:
    """One row's request, as the stage reads it (a `ScheduledRequest` has these too)."""

    sampling_params: SamplingParams
    prompt: list[int]
    output: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


def tokens(n: int, seed: int) -> list[int]:
    """``n`` token ids with repeats (drawn from a third of the vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB // 3, (n,), generator=g).tolist()


def openai_penalties(
    logits: torch.Tensor, output: Sequence[int], presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's formula: mu[j] - c[j] * frequency - float(c[j] > 0) * presence."""
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=VOCAB)
    counts = counts.to(logits.dtype)
    return logits - (presence * (counts > 0).to(logits.dtype) + frequency * counts)


def with_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    out = logits.clone()
    for token_id, value in bias.items():
        out[token_id] += value
    return out


def transformers_repetition(logits: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    processor = transformers.RepetitionPenaltyLogitsProcessor(penalty=penalty)
    return processor(torch.tensor([seen]), logits.unsqueeze(0).clone())[0]


def plain_repetition(logits: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    """transformers' rule from its description: a seen token's logit divided by the penalty
    when positive, multiplied by it otherwise."""
    out = logits.clone()
    for token_id in set(seen):
        value = out[token_id]
        out[token_id] = value / penalty if value > 0 else value * penalty
    return out


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.7), (-1.5, 2.0)])
def test_presence_and_frequency_follow_openais_formula(presence, frequency):
    rows = [
        Row(
            SamplingParams(presence_penalty=presence, frequency_penalty=frequency),
            prompt=tokens(12, seed=i),
            output=tokens(20 + 5 * i, seed=10 + i),
        )
        for i in range(3)
    ]
    logits = random_logits(3)
    expected = torch.stack(
        [openai_penalties(logits[i], row.output, presence, frequency) for i, row in enumerate(rows)]
    )
    apply_logits_stage(logits, rows)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_presence_and_frequency_count_only_the_output():
    prompt = [1, 2, 3]
    row = Row(SamplingParams(presence_penalty=1.0, frequency_penalty=1.0), prompt, output=[])
    logits = random_logits(1)
    before = logits.clone()
    apply_logits_stage(logits, [row])
    assert torch.equal(logits, before)  # the prompt's tokens are not penalized


@pytest.mark.referee
@pytest.mark.parametrize("penalty", [1.3, 0.7, 5.0])
def test_repetition_penalty_equals_transformers_processor(penalty):
    rows = [
        Row(
            SamplingParams(repetition_penalty=penalty),
            prompt=tokens(10, seed=i),
            output=tokens(6 * i, seed=20 + i),
        )
        for i in range(3)
    ]
    logits = random_logits(3, seed=1)
    expected = torch.stack(
        [
            transformers_repetition(logits[i], row.all_token_ids, penalty)
            for i, row in enumerate(rows)
        ]
    )
    apply_logits_stage(logits, rows)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_covers_prompt_and_output(penalty):
    row = Row(SamplingParams(repetition_penalty=penalty), prompt=[3, 4, 4], output=[9, 3])
    logits = random_logits(1, seed=2)
    expected = plain_repetition(logits[0], row.all_token_ids, penalty)
    apply_logits_stage(logits, [row])
    torch.testing.assert_close(logits[0], expected, rtol=0, atol=0)


def test_logit_bias_adds_to_each_listed_token():
    bias = {0: 100.0, 5: -100.0, VOCAB - 1: 2.5}
    row = Row(SamplingParams(logit_bias=bias), prompt=[1])
    logits = random_logits(1, seed=3)
    expected = with_bias(logits[0], bias)
    apply_logits_stage(logits, [row])
    torch.testing.assert_close(logits[0], expected, rtol=0, atol=0)


def test_bias_then_repetition_then_presence_and_frequency():
    """vLLM's order: the bias first, then repetition, then OpenAI's two penalties."""
    params = SamplingParams(
        logit_bias={2: 3.0, 7: -4.0, 40: 1.5},
        repetition_penalty=1.5,
        presence_penalty=0.4,
        frequency_penalty=0.3,
    )
    row = Row(params, prompt=[2, 5, 5, 40], output=[7, 7, 2, 11])
    logits = random_logits(1, seed=4)
    expected = with_bias(logits[0], dict(params.logit_bias))
    expected = plain_repetition(expected, row.all_token_ids, 1.5)
    expected = openai_penalties(expected, row.output, 0.4, 0.3)
    apply_logits_stage(logits, [row])
    torch.testing.assert_close(logits[0], expected, rtol=0, atol=0)


def test_rows_that_use_none_are_untouched():
    plain = SamplingParams(temperature=0.7, top_k=5)
    using = SamplingParams(logit_bias={1: 50.0}, presence_penalty=2.0, repetition_penalty=3.0)
    rows = [
        Row(plain, prompt=[1, 2], output=[1, 1]),
        Row(using, prompt=[1, 2], output=[1, 1]),
        Row(plain, prompt=[3], output=[2]),
    ]
    logits = random_logits(3, seed=5)
    before = logits.clone()
    apply_logits_stage(logits, rows)
    assert torch.equal(logits[0], before[0])
    assert torch.equal(logits[2], before[2])
    assert not torch.equal(logits[1], before[1])


def test_a_batch_that_uses_none_is_left_as_it_was():
    rows = [Row(SamplingParams(), prompt=[1, 2], output=[3]) for _ in range(4)]
    logits = random_logits(4, seed=6)
    before = logits.clone()
    apply_logits_stage(logits, rows)
    assert torch.equal(logits, before)


def test_rows_over_the_same_history_take_their_own_params():
    """Forked choices sample their first token from their leader's row, each with its own
    params and no output yet: each row gets its own bias and penalties."""
    prompt = [4, 4, 8]
    first = SamplingParams(logit_bias={8: -10.0}, repetition_penalty=2.0)
    second = SamplingParams(logit_bias={9: 10.0}, frequency_penalty=1.0)
    logits = random_logits(1, seed=7).repeat(2, 1)
    expected_first = plain_repetition(with_bias(logits[0], {8: -10.0}), prompt, 2.0)
    expected_second = with_bias(logits[1], {9: 10.0})  # no output: nothing to count
    apply_logits_stage(logits, [Row(first, prompt), Row(second, prompt)])
    torch.testing.assert_close(logits[0], expected_first, rtol=0, atol=0)
    torch.testing.assert_close(logits[1], expected_second, rtol=0, atol=0)
