"""The referee on the real model: our engine on the shipped SmolLM2-135M-Instruct GGUF
gives transformers' greedy output on the same file, token for token.

transformers (the referee) dequantizes the GGUF with the gguf package too and runs it in
float32, one prompt at a time (no padding), stopping at eos as we do; so our engine runs
with ``dequantize=True`` (its float32 path; the blocks-as-stored path has its own tests in
``test_quantized_gguf.py``). The prompts are chats
of mixed lengths rendered with the model's own chat template; two share a long prefix, so
prefix caching has blocks to reuse. Decode-only steps run the native decoder
(``kernels.cpu_decoder``); the layer-by-layer path is checked on its own too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend_engine import LLM, SamplingParams
from model_files.checkpoint import Checkpoint
from model_files.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 24
SYSTEM = "You are a concise assistant. Answer in one or two sentences."
HISTORY = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "I am planning a trip to Europe next spring."},
    {"role": "assistant", "content": "That sounds exciting! Which countries are you visiting?"},
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [*HISTORY, {"role": "user", "content": "Italy and Spain. What should I eat in Rome?"}],
    [*HISTORY, {"role": "user", "content": "Portugal. Is Lisbon good for walking?"}],
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "List three prime numbers greater than 100, then sum them."},
    ],
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return Checkpoint(smollm2_gguf).tokenizer()


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    rendered = [tokenizer.encode_chat(chat) for chat in CHATS]
    assert len({len(p) for p in rendered}) == len(rendered)  # mixed lengths
    return rendered


@pytest.fixture(scope="module")
def expected(smollm2_gguf: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    outputs = []
    # Denormals flushed to zero, as the engine runs (cpu_runtime): on this model some
    # activations underflow, and without it one generate call varied from 0.4 s to 20 s.
    flushed = torch.set_flush_denormal(True)
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=model.generation_config.eos_token_id,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    torch.set_flush_denormal(False)
    assert flushed, "this CPU cannot flush denormals; the referee would take minutes"
    return outputs


def test_the_referee_answers_like_the_real_model(
    tokenizer: Tokenizer, expected: list[list[int]]
) -> None:
    assert tokenizer.decode(expected[0]) == "The capital of France is Paris."


@pytest.mark.parametrize("native_decoder", [True, False], ids=["native decoder", "layer by layer"])
def test_greedy_matches_transformers_with_prefix_caching_off(
    smollm2_gguf: Path, prompts: list[list[int]], expected: list[list[int]], native_decoder: bool
) -> None:
    llm = LLM(
        model=str(smollm2_gguf), dtype="float32", dequantize=True, enable_prefix_caching=False
    )
    model = llm.engine.runner.model
    assert model.native_decoder is not None  # decode steps run every layer in one call
    if not native_decoder:
        model.native_decoder = None
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.kv_cache.prefix_cache_hits == 0


def test_greedy_matches_transformers_with_prefix_caching_and_forced_preemption(
    smollm2_gguf: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    # 24 blocks of 8 tokens hold the longest sequence (12 blocks) but not the six (~55).
    llm = LLM(
        model=str(smollm2_gguf),
        dtype="float32",
        dequantize=True,
        enable_prefix_caching=True,
        block_size=8,
        num_kv_blocks=24,
    )
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    # A preempted request's prompt, and the history two chats share, came from the cache.
    assert llm.engine.kv_cache.prefix_cache_hits > 0
