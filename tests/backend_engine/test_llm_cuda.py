"""On a GPU, the engine with the Triton kernels matches transformers token for token."""

from __future__ import annotations

import pytest
import torch

from backend_engine import LLM, SamplingParams
from kernels import dispatch
from model_files.model_config import ModelConfig

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
ENGINE_SETTINGS = {
    "prefix_caching_on": {"enable_prefix_caching": True},
    # chunks after a cached prefix, decodes and prefills in one batch
    "tiny_chunked_prefill_budget": {"max_num_batched_tokens": 7, "block_size": 32},
    "forced_preemption": {"num_kv_blocks": 14, "block_size": 8},
}


def prompts_of_mixed_lengths(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (1, 5, 17, 40)]
    prompts.append([*prompts[3][:32], 7, 8, 9])  # shares a prefix with the 40-token prompt
    return prompts


@pytest.mark.parametrize("settings", list(ENGINE_SETTINGS))
@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_cuda_greedy_matches_transformers(
    demo_checkpoint, transformers_greedy, architecture, settings
):
    from kernels import triton_attention

    assert dispatch.implementation_for(is_cuda=True) is triton_attention
    path = demo_checkpoint(architecture=architecture, size="tiny")
    prompts = prompts_of_mixed_lengths(ModelConfig.from_pretrained(path).vocab_size)
    expected = transformers_greedy(path, prompts, NUM_NEW_TOKENS)

    llm = LLM(model=str(path), device="cuda", dtype="float32", **ENGINE_SETTINGS[settings])
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
