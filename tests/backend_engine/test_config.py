"""EngineConfig's derived defaults (the step's token budget follows the device) and its checks
of the speculative decoding settings."""

from __future__ import annotations

import re
from typing import Any

import pytest

from backend_engine.config import DEFAULT_STEP_TOKENS, EngineConfig


@pytest.mark.parametrize(("device", "expected"), [("cpu", 256), ("cuda", 2048), ("cuda:1", 2048)])
def test_the_step_budget_defaults_to_the_devices(device: str, expected: int) -> None:
    """A CPU step of 2,048 tokens takes seconds (every stream's next token waits for it); a
    GPU's takes milliseconds."""
    config = EngineConfig(model="m", device=device)
    assert config.max_num_batched_tokens is None
    assert config.step_token_budget == expected == DEFAULT_STEP_TOKENS[device.split(":")[0]]


def test_a_step_budget_set_is_kept_on_every_device() -> None:
    assert EngineConfig(model="m", max_num_batched_tokens=4096).step_token_budget == 4096
    assert EngineConfig(model="m", device="cuda", max_num_batched_tokens=64).step_token_budget == 64
    with pytest.raises(ValueError, match="max_num_batched_tokens must be positive"):
        EngineConfig(model="m", max_num_batched_tokens=0)


def test_speculative_decoding_is_off_unless_a_proposer_is_set() -> None:
    config = EngineConfig(model="m")
    assert config.speculative_proposer is None
    assert config.speculative_draft_model is None
    ngram = EngineConfig(model="m", speculative_proposer="ngram", num_speculative_tokens=1)
    assert (ngram.speculative_ngram_min, ngram.speculative_ngram_max) == (1, 4)
    draft = EngineConfig(model="m", speculative_proposer="draft", speculative_draft_model="d")
    assert draft.speculative_draft_model == "d"
    same = EngineConfig(model="m", speculative_ngram_min=3, speculative_ngram_max=3)
    assert same.speculative_ngram_min == same.speculative_ngram_max == 3


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"speculative_proposer": "eagle"},
            "speculative_proposer must be one of ('ngram', 'draft'), got 'eagle'",
        ),
        ({"speculative_proposer": "draft"}, "speculative_draft_model is needed by, and only by"),
        (
            {"speculative_proposer": "ngram", "speculative_draft_model": "d"},
            "speculative_draft_model is needed by, and only by, speculative_proposer='draft'",
        ),
        ({"speculative_draft_model": "d"}, "speculative_draft_model is needed by"),
        (
            {"speculative_ngram_min": 5, "speculative_ngram_max": 3},
            "1 <= speculative_ngram_min <= speculative_ngram_max, got 5 and 3",
        ),
        ({"speculative_ngram_min": 0}, "1 <= speculative_ngram_min"),
        ({"speculative_ngram_max": 0}, "got 1 and 0"),  # below the default minimum
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be at least 1, got 0"),
        (
            {"speculative_crossover_batch_size": 0},
            "speculative_crossover_batch_size must be at least 1, got 0",
        ),
        (
            {"speculative_draft_cost": -0.1},
            "speculative_draft_cost must be 0 or more, got -0.1",
        ),
    ],
)
def test_speculative_settings_are_checked(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(model="m", **settings)
