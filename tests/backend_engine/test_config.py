"""EngineConfig's derived defaults: the step's token budget follows the device."""

from __future__ import annotations

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
