"""The referee: greedy output equals transformers' token for token."""

from __future__ import annotations

import pytest
import torch

from backend_engine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"]
NUM_NEW_TOKENS = 12


def prompts_of_mixed_lengths(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = [1, 5, 16, 17, 40, 63]
    # Two prompts share a long prefix, so prefix caching has something to find.
    prompts = [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]
    prompts.append([*prompts[4][:32], 7, 8, 9])
    return prompts


@pytest.fixture(scope="module", params=ARCHITECTURES)
def case(request, demo_checkpoint, transformers_greedy):
    path = demo_checkpoint(architecture=request.param, size="tiny")
    from model_files.model_config import ModelConfig

    prompts = prompts_of_mixed_lengths(ModelConfig.from_pretrained(path).vocab_size)
    return path, prompts, transformers_greedy(path, prompts, NUM_NEW_TOKENS)


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)

ENGINE_SETTINGS = {
    "prefix_caching_on": {"enable_prefix_caching": True},
    "prefix_caching_off": {"enable_prefix_caching": False},
    "tiny_chunked_prefill_budget": {"max_num_batched_tokens": 7},
    "forced_preemption": {"num_kv_blocks": 14, "block_size": 8},
}


@pytest.mark.parametrize("settings", list(ENGINE_SETTINGS), ids=list(ENGINE_SETTINGS))
def test_greedy_matches_transformers(case, settings):
    path, prompts, expected = case
    llm = LLM(model=str(path), dtype="float32", **ENGINE_SETTINGS[settings])
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    if settings == "forced_preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if settings == "prefix_caching_on":
        # Run again: every prompt is now cached up to its last full block.
        again = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in again] == expected
        assert any(o.num_cached_tokens > 0 for o in again)
    if settings == "tiny_chunked_prefill_budget":
        assert llm.engine.kv_cache.num_used_blocks == 0
