import math

import pytest
import torch

from backend_engine.sampling_params import SamplingParams
from backend_engine.worker.sampler import argmax_rows, sample


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_and_logprobs_are_reported():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0)]
    tokens, logprobs = sample(logits, params, [None, None], gen())
    assert tokens == [1, 0]
    assert logprobs[1] is None
    first = logprobs[0]
    assert first is not None
    assert first.token_id == 1
    expected = torch.log_softmax(logits[0], -1)
    assert math.isclose(first.logprob, float(expected[1]), rel_tol=1e-6)
    assert [t for t, _ in first.top] == [1, 2]


def test_top_k_one_is_greedy():
    logits = torch.randn(4, 50, generator=gen(1))
    params = [SamplingParams(temperature=1.0, top_k=1)] * 4
    tokens, _ = sample(logits, params, [None] * 4, gen())
    assert tokens == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    params = [SamplingParams(temperature=1.0, top_p=0.8)]
    seen = {sample(logits, params, [None], gen(s))[0][0] for s in range(200)}
    assert seen == {0, 1}


def test_same_seed_same_tokens_whatever_the_batch():
    logits = torch.randn(3, 100, generator=gen(2))
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=1.0)
    a, _ = sample(logits[:1], [seeded], [gen(42)], gen(0))
    b, _ = sample(logits, [seeded, other, other], [gen(42), None, None], gen(5))
    assert a[0] == b[0]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = probs.log().unsqueeze(0)
    g = gen(3)
    counts = torch.zeros(3)
    for _ in range(2000):
        t, _ = sample(logits, [SamplingParams(temperature=1.0)], [None], g)
        counts[t[0]] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.04)


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(2, 30, generator=gen(4))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=5.0)]
    tokens, _ = sample(logits, params, [None, None], gen())
    assert tokens[0] == int(logits[0].argmax())


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"top_p": 0.0}, "top_p must be in"),
        ({"temperature": -1}, "temperature must be non-negative"),
        ({"top_k": -1}, "top_k must be in"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ],
)
def test_invalid_params_are_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_rows_picks_what_torch_picks(dtype: torch.dtype) -> None:
    """The first maximum on ties, the first NaN, -inf rows, strided rows: as torch.argmax."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(6, 1000, generator=gen).to(dtype)
    values[1, [10, 500, 999]] = 50.0  # a tie
    values[2, [7, 300]] = float("nan")
    values[3] = float("-inf")
    values[4, 0] = float("inf")
    for rows in (values, values[:, ::3], values[:0]):
        got = argmax_rows(rows)
        assert got.dtype == torch.int64
        assert torch.equal(got, rows.argmax(dim=-1))
