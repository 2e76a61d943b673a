"""bench.perplexity: the windows, the formula, and the score against transformers' own
perplexity of the same windows (the referee)."""

from __future__ import annotations

import math

import pytest
import torch

from bench.perplexity import perplexity, reference_text, score, windows
from model_files.model_config import ModelConfig


def test_windows_cut_the_tokens_and_drop_a_lone_last_one() -> None:
    assert windows(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]
    assert windows(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    with pytest.raises(ValueError, match="at least 2 tokens"):
        windows([1, 2], 1)


def test_perplexity_is_the_exponent_of_the_mean_negative_log_likelihood() -> None:
    assert perplexity([math.log(0.5)] * 4) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no predicted tokens"):
        perplexity([])


def test_the_reference_text_is_long_english_prose() -> None:
    text = reference_text()
    assert len(text.split()) > 40_000  # some 90,000 SmolLM2 tokens: room for 20,000 and more
    assert "The Python Language Reference" in text or "expression" in text


@pytest.mark.referee
def test_the_engine_s_perplexity_equals_transformers(demo_checkpoint) -> None:
    transformers = pytest.importorskip("transformers")
    path = demo_checkpoint(size="tiny")
    vocab = ModelConfig.from_pretrained(path).vocab_size
    g = torch.Generator().manual_seed(0)
    token_ids = torch.randint(3, vocab, (70,), generator=g).tolist()
    prompts = windows(token_ids, 32)  # 32, 32 and 6 tokens
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected: list[float] = []
    with torch.no_grad():
        for prompt in prompts:
            logits = model(torch.tensor([prompt])).logits[0]
            picked = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(prompt[1:])[:, None])
            expected.extend(picked[:, 0].tolist())
    got = score(str(path), prompts)
    assert len(got) == len(expected) == 70 - 3
    assert got == pytest.approx(expected, abs=1e-4)
    assert perplexity(got) == pytest.approx(perplexity(expected), rel=1e-4)
