"""The shipped SmolLM2 GGUF served from its blocks as stored, against the same file widened
to float32 (``dequantize=True``, the path the transformers referee checks).

Both arms hold the same weights: a Q4_1 or Q8_0 block dequantized is exact. What differs is
the arithmetic: the quantized kernel rounds each block of 32 activations to two int8 parts
(``kernels.cpu_quant_linear``'s INT8_SPLIT_ACTIVATIONS, about 16 bits) and sums in another
order. So:

- greedy agreement, teacher-forced: over 50 chat prompts, the float32 arm's greedy output of
  128 tokens is read by the quantized model, ``WIDEN_MIN_ROWS`` - 1 tokens a step (so every
  linear runs the split int8 kernel, as the native decoder's steps do: from ``WIDEN_MIN_ROWS``
  rows a step widens the blocks for a float32 matmul),
  and its argmax at every output position must be the float32 arm's token for at least 99%
  of them. (A free-running
  comparison would count every token after a first near-tie as different, which measures the
  tie, not the kernel.)
- logits, per position, on whole sequences: within the tolerance below;
- the whole-step native decoder gives the layer-by-layer path's tokens, and its logprobs to
  within a rounding step: the float32 path's two routes differ by ~1e-5 already (measured),
  and an activation that lands on the other side of an int8 rounding boundary turns that
  into ~1e-4 here.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from backend_engine import LLM, SamplingParams
from backend_engine.models import load_model
from backend_engine.models.llama import CausalLM
from backend_engine.models.quantized_linear import QuantizedEmbedding, QuantizedLinear
from kernels import cpu_quant_linear
from kernels.cpu_quant_linear import WIDEN_MIN_ROWS, GGUFBlockWeight
from model_files.checkpoint import Checkpoint
from tests.support.model_logits import whole_sequence_logits

OUTPUT_TOKENS = 128
DECODE_ROWS = WIDEN_MIN_ROWS - 1  # rows a step when scoring: the most the int8 kernel runs
MIN_AGREEMENT = 0.99
# Per position, the largest |logit difference| over the 49k-token vocabulary (logits span
# about 40): measured on this file at 0.003 on average and 0.008 at worst with the default
# split int8 activations (~16 bits); one int8 pass gave ~1 and 3.3, and 97.8% agreement.
MEAN_MAX_LOGIT_ERROR = 0.01
WORST_LOGIT_ERROR = 0.05
NATIVE_LOGPROB_TOLERANCE = 5e-3  # measured 6e-4

SUBJECTS = ["the Moon", "photosynthesis", "the French Revolution", "binary search", "coffee"]
ASKS = [
    "Explain {} to a ten-year-old.",
    "Give me three facts about {}.",
    "Write a short poem about {}.",
    "What is the most common misconception about {}?",
    "Summarise the history of {} in a paragraph.",
    "How would you teach {} in one lesson?",
    "List the pros and cons of studying {}.",
    "Write a tweet about {}.",
    "What questions should I ask an expert on {}?",
    "Describe {} using only simple words.",
]
CHATS = [
    [{"role": "user", "content": ask.format(subject)}]
    for ask, subject in itertools.product(ASKS, SUBJECTS)
]


@pytest.fixture(scope="module")
def prompts(smollm2_gguf: Path) -> list[list[int]]:
    tokenizer = Checkpoint(smollm2_gguf).tokenizer()
    return [tokenizer.encode_chat(chat) for chat in CHATS]


@pytest.fixture(scope="module")
def float32_outputs(smollm2_gguf: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(smollm2_gguf), dtype="float32", dequantize=True, show_progress=False)
    greedy = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    return [output.token_ids for output in llm.generate(prompts, greedy)]


@pytest.fixture(scope="module")
def quantized_llm(smollm2_gguf: Path) -> LLM:
    # Without prefix caching: a second run would reuse the first one's prompt blocks and
    # prefill only the rest, which sums attention in another order.
    return LLM(str(smollm2_gguf), dtype="float32", enable_prefix_caching=False, show_progress=False)


@pytest.fixture(scope="module")
def stored_model(smollm2_gguf: Path) -> CausalLM:
    checkpoint = Checkpoint(smollm2_gguf)
    config = checkpoint.model_config()
    return load_model(checkpoint, config, "float32", "cpu", keep_gguf_blocks=True)


def test_the_weights_stay_in_the_files_blocks(smollm2_gguf: Path) -> None:
    checkpoint = Checkpoint(smollm2_gguf)
    model = load_model(
        checkpoint, checkpoint.model_config(), "float32", "cpu", keep_gguf_blocks=True
    )
    layer = model.model.layers[0]
    for linear in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
        model.lm_head,
    ):
        assert isinstance(linear, QuantizedLinear)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    # tied: the output projection's (tiled, where the kernel reads tiles) blocks are the table's
    (output_weight,) = model.lm_head.segments
    assert output_weight is model.model.embed_tokens.weight
    assert isinstance(output_weight, GGUFBlockWeight)
    assert output_weight.tiled == cpu_quant_linear.tiles_available()
    file_bytes = sum(int(tensor.n_bytes) for tensor in checkpoint.reader.tensors)
    assert resident_weight_bytes(model) <= 1.2 * file_bytes


def test_greedy_output_agrees_with_the_float32_path(
    stored_model: CausalLM, prompts: list[list[int]], float32_outputs: list[list[int]]
) -> None:
    agree = total = 0
    for prompt, output in zip(prompts, float32_outputs, strict=True):
        logits = whole_sequence_logits(stored_model, prompt + output, DECODE_ROWS)
        # the logits at position i predict token i + 1
        predicted = logits[len(prompt) - 1 : -1].argmax(dim=1).tolist()
        agree += sum(p == t for p, t in zip(predicted, output, strict=True))
        total += len(output)
    assert total == len(CHATS) * OUTPUT_TOKENS
    assert agree / total >= MIN_AGREEMENT, f"{agree} of {total} tokens agree"


def test_logits_per_position_stay_within_the_tolerance(
    smollm2_gguf: Path,
    stored_model: CausalLM,
    prompts: list[list[int]],
    float32_outputs: list[list[int]],
) -> None:
    checkpoint = Checkpoint(smollm2_gguf)
    widened = load_model(checkpoint, checkpoint.model_config(), "float32", "cpu")
    errors = []
    for prompt, output in list(zip(prompts, float32_outputs, strict=True))[:: len(ASKS)]:
        tokens = prompt + output
        want = whole_sequence_logits(widened, tokens)
        got = whole_sequence_logits(stored_model, tokens, DECODE_ROWS)
        errors.append((got - want).abs().amax(dim=1))
    per_position = torch.cat(errors)
    assert float(per_position.mean()) <= MEAN_MAX_LOGIT_ERROR, per_position.mean()
    assert float(per_position.max()) <= WORST_LOGIT_ERROR, per_position.max()


def test_the_native_decoder_agrees_with_the_layer_by_layer_path(
    quantized_llm: LLM, prompts: list[list[int]]
) -> None:
    model = quantized_llm.engine.runner.model
    decoder = model.native_decoder
    assert decoder is not None  # quantized linears run in the whole-step decoder
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    native = quantized_llm.generate(prompts[:6], params)
    model.native_decoder = None
    try:
        layered = quantized_llm.generate(prompts[:6], params)
    finally:
        model.native_decoder = decoder
    assert [o.token_ids for o in native] == [o.token_ids for o in layered]
    differences = [
        abs(ours.logprob - theirs.logprob)
        for a, b in zip(native, layered, strict=True)
        for ours, theirs in zip(a.logprobs, b.logprobs, strict=True)
    ]
    assert max(differences) <= NATIVE_LOGPROB_TOLERANCE


def resident_weight_bytes(model: CausalLM) -> int:
    """The bytes of every weight the model holds, each buffer once (tied ones share)."""
    seen: set[int] = set()
    total = 0

    def count(tensor: torch.Tensor) -> None:
        nonlocal total
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.nbytes

    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            for segment in module.segments:
                assert hasattr(segment, "blocks")
                count(segment.blocks)
        elif isinstance(module, QuantizedEmbedding):
            count(module.weight.blocks)
    for parameter in model.parameters():
        count(parameter)
    return total
