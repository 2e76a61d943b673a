"""Speculative decoding with sampling: rejection sampling keeps the output distribution
exactly the target's.

The demo checkpoint's vocabulary (512 tokens) is made a three-token one by ``logit_bias``: +50
on A, B and C leaves every other token under e^-40 of their probability, while their relative
probabilities stay the model's own (equal biases cancel in the softmax). The prompt ends in a
pattern over A, B and C, so whichever of them comes first, the n-gram proposer (min n = 1)
finds it in the prompt and proposes what followed it there: a draft with a real chance of
being kept or rejected. The first three tokens of many seeded requests (their second and
third are where drafts are verified) are compared by a chi-square test with the exact
distribution, computed from the model's logits (transformers, float32) with the same bias
and temperature: at significance 0.001, over a fixed set of seeds, so the outcome is fixed.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from backend_engine import LLM, SamplingParams
from backend_engine.outputs import SpeculativeCounts

A, B, C = 17, 201, 333
SUPPORT = (A, B, C)
BIAS = 50.0
TEMPERATURE = 0.8
NUM_TOKENS = 3
NUM_DRAWS = 2000
SIGNIFICANCE = 1e-3
PROMPT = [
    *torch.randint(3, 400, (5,), generator=torch.Generator().manual_seed(0)).tolist(),
    *(A, B, C, A, C, B, B, A, C, C, A, B),
]


def params(seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=TEMPERATURE,
        seed=seed,
        max_tokens=NUM_TOKENS,
        ignore_eos=True,
        logit_bias=dict.fromkeys(SUPPORT, BIAS),
    )


@pytest.fixture(scope="module")
def checkpoint(demo_checkpoint: Callable[..., Path]) -> Path:
    return demo_checkpoint(size="tiny")


@pytest.fixture(scope="module")
def speculating(checkpoint: Path) -> LLM:
    speculative: dict[str, Any] = {
        "speculative_proposer": "ngram",
        "speculative_ngram_min": 1,
        "speculative_crossover_batch_size": 100_000,  # every step speculates
        "speculative_draft_cost": 0.0,  # drafts free: k follows acceptance alone
    }
    return LLM(
        model=str(checkpoint),
        dtype="float32",
        block_size=16,
        max_num_seqs=128,
        max_num_batched_tokens=512,  # room in every step for each decode's draft
        **speculative,
    )


def exact_distribution(checkpoint: Path) -> dict[tuple[int, ...], float]:
    """P(first NUM_TOKENS tokens) under the biased, tempered target: a product of each
    position's softmax((logits + bias) / temperature), over the whole vocabulary."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.eval()
    bias = torch.zeros(model.config.vocab_size)
    bias[list(SUPPORT)] = BIAS
    probs: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for head in itertools.product(SUPPORT, repeat=NUM_TOKENS - 1):
            ids = torch.tensor([PROMPT + list(head)])
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, -NUM_TOKENS:]
            rows = torch.softmax((logits.double() + bias) / TEMPERATURE, dim=-1)  # [3, vocab]
            for last in SUPPORT:
                tokens = (*head, last)
                probs[tokens] = float(
                    torch.prod(torch.stack([rows[i, t] for i, t in enumerate(tokens)]))
                )
    return probs


def chi_square_p_value(
    observed: Counter[tuple[int, ...]], expected: dict[tuple[int, ...], float], num_draws: int
) -> float:
    """Pearson's test; cells expected under 5 draws are pooled into one."""
    cells = sorted(expected, key=lambda c: expected[c], reverse=True)
    big = [c for c in cells if expected[c] * num_draws >= 5]
    small = [c for c in cells if expected[c] * num_draws < 5]
    counts = [observed[c] for c in big]
    means = [expected[c] * num_draws for c in big]
    pooled_mean = num_draws - sum(means)  # the rest, including off-support tokens
    pooled_count = num_draws - sum(counts)
    if small or pooled_mean > 1e-9:
        counts.append(pooled_count)
        means.append(max(pooled_mean, 1e-12))
    statistic = sum((o - e) ** 2 / e for o, e in zip(counts, means, strict=True))
    degrees = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2), torch.tensor(statistic / 2)))


def test_sampled_tokens_follow_the_targets_distribution(checkpoint: Path, speculating: LLM) -> None:
    expected = exact_distribution(checkpoint)
    assert sum(expected.values()) == pytest.approx(1.0, abs=1e-9)
    assert max(expected.values()) < 0.5  # the draws do vary
    outputs = speculating.generate([PROMPT] * NUM_DRAWS, [params(s) for s in range(NUM_DRAWS)])
    observed = Counter(tuple(o.token_ids) for o in outputs)
    counts: SpeculativeCounts = speculating.engine.stats().speculative["ngram"]
    # Every request verified one draft, for its second token; many were kept, many not.
    assert counts.num_verified_chunks == counts.num_draft_tokens == NUM_DRAWS
    assert 0.1 * NUM_DRAWS < counts.num_accepted_tokens < 0.9 * NUM_DRAWS, counts
    p_value = chi_square_p_value(observed, expected, NUM_DRAWS)
    assert p_value > SIGNIFICANCE, (p_value, observed, expected)


def test_seeded_runs_are_reproducible(speculating: LLM) -> None:
    before = speculating.engine.stats().speculative["ngram"].num_draft_tokens
    seeds = list(range(500, 540))
    first = speculating.generate([PROMPT] * len(seeds), [params(s) for s in seeds])
    again = speculating.generate([PROMPT] * len(seeds), [params(s) for s in seeds])
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert len({tuple(o.token_ids) for o in first}) > 5
    assert speculating.engine.stats().speculative["ngram"].num_draft_tokens > before
