"""GPTQ's calibration: the Hessians are the second moment of each linear's real inputs, the
text is not the text perplexity is measured on, and a model loaded with GPTQ is closer to its
float self than one rounded to the nearest."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import torch

from backend_engine import config as engine_config
from backend_engine.models import load_model
from backend_engine.models.calibration import (
    CALIBRATION_METHODS,
    calibration_text,
    calibration_token_ids,
    input_hessians,
)
from backend_engine.models.llama import DecoderLayer
from model_files.checkpoint import Checkpoint
from tests.support.model_logits import whole_sequence_logits

PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tokens(count: int, vocab_size: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count,), generator=gen).tolist()


def test_the_hessians_are_each_linears_inputs_second_moment(
    demo_checkpoint: Callable[..., Path],
) -> None:
    checkpoint = Checkpoint(demo_checkpoint(size="tiny"))
    config = checkpoint.check()
    model = load_model(checkpoint, config, "float32", "cpu")
    token_ids = tokens(40, config.vocab_size)
    hessians = input_hessians(model, token_ids, window=16)  # prompts of 16, 16 and 8

    names = {
        f"model.layers.{layer}.{'self_attn' if part[0] in 'qkvo' else 'mlp'}.{part}.weight"
        for layer in range(config.num_hidden_layers)
        for part in PARTS
    }
    assert set(hessians) == names
    # the first layer's q/k/v read the normed embeddings, whatever the position
    layer = "model.layers.0.self_attn"
    with torch.inference_mode():
        first_layer = cast(DecoderLayer, model.model.layers[0])
        x = first_layer.input_layernorm(model.model.embed_tokens(torch.tensor(token_ids)))
    expected = 2 * x.double().T @ x.double() / len(token_ids)
    torch.testing.assert_close(hessians[f"{layer}.q_proj.weight"], expected.float())
    assert hessians[f"{layer}.k_proj.weight"] is hessians[f"{layer}.q_proj.weight"]
    down = hessians["model.layers.1.mlp.down_proj.weight"]
    assert tuple(down.shape) == (config.intermediate_size,) * 2
    torch.testing.assert_close(down, down.T)
    assert float(torch.linalg.eigvalsh(down.double()).min()) > -1e-6 * float(down.abs().max())


def test_the_calibration_text_is_not_the_perplexity_text() -> None:
    from pydoc_data.topics import topics

    reference = "\n\n".join(topics.values())
    text = calibration_text()
    assert len(text) > 100_000  # some 28,000 SmolLM2 tokens, 4,096 used
    docstrings = text.split("\n\n")
    # a paragraph from the calibration text is (almost) never in the help() topics
    long_paragraphs = [p for p in docstrings if len(p) >= 200]
    shared = [p for p in long_paragraphs if p[:200] in reference]
    assert len(long_paragraphs) > 100
    assert len(shared) <= len(long_paragraphs) // 50


@torch.inference_mode()
def test_gptq_keeps_the_model_closer_to_its_float_self(
    demo_checkpoint: Callable[..., Path],
) -> None:
    checkpoint = Checkpoint(demo_checkpoint(size="tiny"))
    config = checkpoint.check()
    prompt = calibration_token_ids(checkpoint.tokenizer(), 4096)[-128:]  # text GPTQ was fitted on
    float_logits = whole_sequence_logits(load_model(checkpoint, config, "float32", "cpu"), prompt)

    def error(calibration: str) -> float:
        model = load_model(
            checkpoint,
            config,
            "float32",
            "cpu",
            quantization="int4",
            group_size=64,
            calibration=calibration,
        )
        return float(torch.linalg.norm(whole_sequence_logits(model, prompt) - float_logits))

    assert error("gptq") < error("rtn")


def test_an_unknown_calibration_is_refused(demo_checkpoint: Callable[..., Path]) -> None:
    checkpoint = Checkpoint(demo_checkpoint(size="tiny"))
    with pytest.raises(ValueError, match="calibration must be one of"):
        load_model(checkpoint, checkpoint.check(), "float32", "cpu", calibration="awq")
    with pytest.raises(ValueError, match="quantization_calibration must be one of"):
        engine_config.EngineConfig(model="m", quantization_calibration="awq")


def test_the_engine_settings_name_the_same_methods() -> None:
    assert engine_config.QUANTIZATION_CALIBRATIONS == CALIBRATION_METHODS
