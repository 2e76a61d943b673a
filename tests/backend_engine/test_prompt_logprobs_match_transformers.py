"""The referee for prompt logprobs: each prompt token's log-probability given those before it,
and its top alternatives, equal transformers' log-softmax over the same prompt, however the
prompt is prefilled (chunked, after a preemption, or when the prefix cache holds it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend_engine import LLM, SamplingParams
from backend_engine.outputs import RequestOutput
from model_files.model_config import ModelConfig

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.referee

ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM"]
ATOL = 1e-4  # as the model's logits against transformers' (tests/backend_engine/test_model.py)
NUM_TOP = 3


def prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (1, 2, 9, 17, 40)]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def case(request, demo_checkpoint) -> tuple[Path, list[list[int]], list[torch.Tensor]]:
    path = demo_checkpoint(architecture=request.param, size="tiny")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = prompts(ModelConfig.from_pretrained(path).vocab_size)
    with torch.no_grad():
        referee = [torch.log_softmax(model(torch.tensor([p])).logits[0], -1) for p in batch]
    return path, batch, referee  # referee[i]: [len(prompt), vocab]


PARAMS = SamplingParams(
    temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=NUM_TOP, logprobs=1
)


def assert_matches_referee(output: RequestOutput, prompt: list[int], referee: torch.Tensor) -> None:
    entries = output.prompt_logprobs
    assert entries is not None
    assert len(entries) == len(prompt)
    assert entries[0] is None
    for j in range(1, len(prompt)):
        entry = entries[j]
        assert entry is not None
        expected = referee[j - 1]  # position j - 1 predicts token j
        assert entry.token_id == prompt[j]
        assert entry.logprob == pytest.approx(float(expected[prompt[j]]), abs=ATOL)
        top_values, top_ids = expected.topk(NUM_TOP)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=ATOL)


SETTINGS = {
    "whole_prompts": {},
    "tiny_chunked_prefill_budget": {"max_num_batched_tokens": 7},
    "forced_preemption": {"num_kv_blocks": 13, "block_size": 4, "max_num_batched_tokens": 16},
}


@pytest.mark.parametrize("settings", list(SETTINGS), ids=list(SETTINGS))
def test_prompt_logprobs_match_transformers(case, settings):
    path, batch, referee = case
    llm = LLM(model=str(path), dtype="float32", **SETTINGS[settings])
    outputs = llm.generate(batch, PARAMS)
    for output, prompt, expected in zip(outputs, batch, referee, strict=True):
        assert output.finish_reason == "length"
        assert_matches_referee(output, prompt, expected)
    if settings == "forced_preemption":
        assert llm.engine.scheduler.num_preemptions > 0


def test_a_cached_prefix_does_not_skip_them(case):
    path, batch, referee = case
    llm = LLM(model=str(path), dtype="float32", block_size=4, enable_prefix_caching=True)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    warm = llm.generate(batch, plain)  # every prompt is now cached up to its last full block
    again = llm.generate(batch, plain)
    assert again[-1].num_cached_tokens > 0
    outputs = llm.generate(batch, PARAMS)
    for output, prompt, expected, first in zip(outputs, batch, referee, warm, strict=True):
        assert_matches_referee(output, prompt, expected)
        assert output.num_cached_tokens == 0  # computed, not read from the cache
        assert output.token_ids == first.token_ids
