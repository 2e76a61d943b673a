"""Fixtures shared by the engine tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.triton_interpreter import use_interpreter_without_gpu

use_interpreter_without_gpu()  # before anything here imports triton

import torch  # noqa: E402

GreedyReference = Callable[[Path, list[list[int]], int], list[list[int]]]


@pytest.fixture(scope="session")
def transformers_greedy() -> GreedyReference:
    """``transformers_greedy(path, prompts, num_new_tokens)``: the referee's greedy tokens.

    transformers on CPU in float32, one prompt at a time (no padding), exactly
    ``num_new_tokens`` tokens each with eos ignored, as ``SamplingParams(ignore_eos=True)``
    does (``min_new_tokens`` would instead forbid eos and change the greedy choice).
    """
    transformers = pytest.importorskip("transformers")

    def generate(path: Path, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
        model.generation_config.eos_token_id = None
        outputs = []
        with torch.no_grad():
            for prompt in prompts:
                ids = torch.tensor([prompt])
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=num_new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
                outputs.append(out[0, len(prompt) :].tolist())
        return outputs

    return generate
