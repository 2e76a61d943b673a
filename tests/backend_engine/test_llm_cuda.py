"""On a GPU, the engine with the Triton kernels matches transformers token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend_engine import LLM, SamplingParams
from backend_engine.model_config import ModelConfig
from kernels import dispatch

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


def reference_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers on CPU in float32, exactly NUM_NEW_TOKENS tokens (eos ignored)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize("settings", list(ENGINE_SETTINGS))
@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_cuda_greedy_matches_transformers(demo_checkpoint, architecture, settings):
    from kernels import triton_attention

    assert dispatch.implementation_for(is_cuda=True) is triton_attention
    path = demo_checkpoint(architecture=architecture, size="tiny")
    prompts = prompts_of_mixed_lengths(ModelConfig.from_pretrained(path).vocab_size)
    expected = reference_greedy(path, prompts)

    llm = LLM(model=str(path), device="cuda", dtype="float32", **ENGINE_SETTINGS[settings])
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
