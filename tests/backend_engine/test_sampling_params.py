"""SamplingParams refuses what the sampler cannot run, at construction, not mid-step."""

from __future__ import annotations

import pytest
import torch

from backend_engine.sampling_params import MAX_SEED, MAX_TOP_K, MIN_SEED, SamplingParams


@pytest.mark.parametrize("seed", [MIN_SEED, -1, 0, 2**63 - 1, MAX_SEED])
def test_every_accepted_seed_seeds_a_generator(seed: int) -> None:
    params = SamplingParams(seed=seed)
    assert params.seed is not None
    torch.Generator().manual_seed(params.seed)  # what ModelRunner does with it


@pytest.mark.parametrize("seed", [MIN_SEED - 1, MAX_SEED + 1, 2**64, -(2**70)])
def test_a_seed_the_generator_cannot_take_is_refused(seed: int) -> None:
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)
    with pytest.raises((ValueError, RuntimeError)):
        torch.Generator().manual_seed(seed)  # the range is torch's, not ours


@pytest.mark.parametrize("top_k", [-1, MAX_TOP_K + 1, 10**20])
def test_top_k_out_of_range_is_refused(top_k: int) -> None:
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=top_k)
    SamplingParams(top_k=MAX_TOP_K)
