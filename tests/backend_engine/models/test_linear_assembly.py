"""Models whose linears are built from quantized shards as they load: a GGUF file's blocks kept
as stored (mixed types in a fused linear, a float shard among quantized ones, biases, tied
embeddings), and a float checkpoint quantized at load; each against the same weights widened
to float32."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from backend_engine.models import load_model
from backend_engine.models.llama import CausalLM
from backend_engine.models.quantized_linear import QuantizedEmbedding, QuantizedLinear
from model_files.checkpoint import Checkpoint
from tests.support.gguf_files import hf_tensors, write_gguf
from tests.support.model_logits import whole_sequence_logits

TOKENS = [1, 17, 42, 5, 99, 3, 64, 8, 21, 77, 2, 30, 11, 90, 45, 6, 13, 58, 36, 24]


def both(path: Path, **options: object) -> tuple[CausalLM, CausalLM]:
    """(the model widened to float32, the model as `options` load it)."""
    checkpoint = Checkpoint(path)
    config = checkpoint.model_config()
    widened = load_model(checkpoint, config, "float32", "cpu")
    kept = load_model(checkpoint, config, "float32", "cpu", **options)  # type: ignore[arg-type]
    return widened, kept


def assert_close_logits(widened: CausalLM, kept: CausalLM, tolerance: float) -> None:
    want, got = whole_sequence_logits(widened, TOKENS), whole_sequence_logits(kept, TOKENS)
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= tolerance * scale


def test_a_fused_linear_of_two_block_types_runs_as_two_segments(tmp_path: Path) -> None:
    tensors = hf_tensors(tied=True)
    # every layer's v in Q8_0 beside Q4_0 q and k (llama.cpp's q4_k_m mixes types alike)
    raw = {
        f"blk.{layer}.attn_v.weight": (
            gguf.quants.quantize(
                tensors.pop(f"model.layers.{layer}.self_attn.v_proj.weight"), Q.Q8_0
            ),
            Q.Q8_0,
        )
        for layer in range(2)
    }
    path = write_gguf(tmp_path / "m.gguf", tensors, qtype=Q.Q4_0, raw=raw)
    widened, kept = both(path, keep_gguf_blocks=True)
    qkv = kept.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear)
    assert [s.quant_type.name for s in qkv.segments] == ["Q4_0", "Q8_0"]  # type: ignore[union-attr]
    assert isinstance(kept.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(kept.lm_head, QuantizedLinear)  # tied: the embedding's blocks
    assert kept.lm_head.segments[0] is kept.model.embed_tokens.weight
    assert_close_logits(widened, kept, 1e-2)


def test_a_float_shard_among_quantized_ones_makes_a_float_linear(tmp_path: Path) -> None:
    tensors = hf_tensors()
    raw = {
        f"blk.{layer}.attn_v.weight": (
            tensors.pop(f"model.layers.{layer}.self_attn.v_proj.weight"),
            Q.F32,
        )
        for layer in range(2)
    }
    path = write_gguf(tmp_path / "m.gguf", tensors, qtype=Q.Q8_0, raw=raw)
    widened, kept = both(path, keep_gguf_blocks=True)
    qkv = kept.model.layers[0].self_attn.qkv_proj
    assert type(qkv) is nn.Linear
    assert torch.equal(qkv.weight, widened.model.layers[0].self_attn.qkv_proj.weight)
    assert isinstance(kept.model.layers[0].mlp.gate_up_proj, QuantizedLinear)
    assert_close_logits(widened, kept, 1e-2)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_qwen2_biases_ride_with_their_quantized_linear(tmp_path: Path, qtype: Q) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_tensors(bias=True), arch="qwen2", qtype=qtype)
    widened, kept = both(path, keep_gguf_blocks=True)
    qkv = kept.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear)
    assert qkv.bias is not None
    assert torch.equal(qkv.bias, widened.model.layers[1].self_attn.qkv_proj.bias)
    assert_close_logits(widened, kept, 1e-2)


def test_gguf_blocks_are_kept_on_the_cpu_only(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_tensors(), qtype=Q.Q8_0)
    checkpoint = Checkpoint(path)
    with pytest.raises(ValueError, match="CPU only"):
        load_model(checkpoint, checkpoint.model_config(), "float32", "cuda", keep_gguf_blocks=True)


@pytest.mark.parametrize(
    ("quantization", "group_size", "tolerance"),
    [("int8", 32, 0.02), ("int4", 32, 0.25), ("int4", 64, 0.3)],
)
def test_a_float_checkpoint_quantized_at_load(
    demo_checkpoint: Callable[..., Path], quantization: str, group_size: int, tolerance: float
) -> None:
    widened, kept = both(
        demo_checkpoint(size="tiny"), quantization=quantization, group_size=group_size
    )
    layer = kept.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.mlp.down_proj, kept.lm_head):
        assert isinstance(linear, QuantizedLinear)
    assert isinstance(kept.model.embed_tokens, QuantizedEmbedding)  # int8 on the CPU
    stored = layer.mlp.down_proj.weight_bytes()
    assert stored < widened.model.layers[0].mlp.down_proj.weight.nbytes / 3
    assert_close_logits(widened, kept, tolerance)
