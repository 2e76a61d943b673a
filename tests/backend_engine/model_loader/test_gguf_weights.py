"""GGUF files read as Hugging Face checkpoints: metadata to config, tensors to HF names,
dequantized exactly as the gguf package's reference, llama.cpp's q/k permutation undone,
and files the engine cannot serve refused by name. The files are small synthetic ones
written with ``gguf.GGUFWriter``, laid out as llama.cpp's converter lays them out."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from backend_engine.model_loader.gguf_weights import (
    GGUFError,
    hf_config,
    iter_gguf_weights,
    open_gguf,
    unpermute_rows,
)
from model_files.model_config import ModelConfig
from tests.support.gguf_files import (
    CONTEXT,
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    VOCAB,
    hf_tensors,
    llama_cpp_permute,
    write_gguf,
)


def loaded(path: Path) -> dict[str, torch.Tensor]:
    weights = dict(iter_gguf_weights(open_gguf(path), torch.float32))
    assert all(t.numpy().flags.writeable for t in weights.values())  # not the mapped file
    return weights


def test_the_metadata_becomes_the_models_config(tmp_path: Path) -> None:
    reader = open_gguf(write_gguf(tmp_path / "m.gguf", hf_tensors(tied=True)))
    config = ModelConfig.from_dict(hf_config(reader))
    assert config.architecture == "LlamaForCausalLM"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        HIDDEN,
        FFN,
        LAYERS,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        HEADS,
        KV_HEADS,
        HEAD_DIM,
    )
    assert (config.vocab_size, config.max_position_embeddings) == (VOCAB, CONTEXT)
    assert config.rope_theta == 100_000.0
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.tie_word_embeddings
    assert not config.attention_bias
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


@pytest.mark.parametrize("tied", [False, True])
def test_f32_tensors_come_back_under_hf_names_with_q_and_k_unpermuted(
    tmp_path: Path, tied: bool
) -> None:
    original = hf_tensors(tied=tied)
    weights = loaded(write_gguf(tmp_path / "m.gguf", original))
    assert set(weights) == set(original)
    for name, values in original.items():
        assert torch.equal(weights[name], torch.from_numpy(values)), name
    assert hf_config(open_gguf(tmp_path / "m.gguf"))["tie_word_embeddings"] == tied


def test_unpermute_inverts_llama_cpps_permutation() -> None:
    rows = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    assert np.array_equal(unpermute_rows(llama_cpp_permute(rows, 4), 4), rows)
    assert not np.array_equal(llama_cpp_permute(rows, 4), rows)


# The most a value may move, as a fraction of the largest magnitude in its block of 32. F16
# and BF16 round to half an ulp of the value itself (2^-11, 2^-8 of it). A block type rounds
# to steps d (Q8_0: absmax/127; Q4_0: absmax/8; Q4_1: (max - min)/15 <= 2 absmax/15), half a
# step away at most, except Q4_0's side opposite the largest value, which clamps at +7, up to
# a whole step away. Its float16 scale adds up to 2^-11 d per quantized unit (127, 8, 15), and
# Q4_1's float16 minimum up to 2^-11 absmax.
_F16_ULP = 2.0**-11
QUANTIZATION_ERROR = {
    Q.F16: _F16_ULP,
    Q.BF16: 2.0**-8,
    Q.Q8_0: (0.5 + 127 * _F16_ULP) / 127,
    Q.Q4_0: (1 + 8 * _F16_ULP) / 8,
    Q.Q4_1: (0.5 + 15 * _F16_ULP) * 2 / 15 + _F16_ULP,
}


def _block_scale(values: np.ndarray, block: int = 32) -> np.ndarray:
    """Each value's block's largest magnitude (blocks of ``block`` along a row)."""
    rows, cols = values.shape
    blocks = np.abs(values).reshape(rows, cols // block, block).max(axis=-1, keepdims=True)
    return np.broadcast_to(blocks, (rows, cols // block, block)).reshape(rows, cols)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_tensors_equal_the_gguf_reference_dequantizer(tmp_path: Path, qtype: Q) -> None:
    original = hf_tensors()
    weights = loaded(write_gguf(tmp_path / "m.gguf", original, qtype=qtype))
    for name, values in original.items():
        if values.ndim != 2:
            continue
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = HEADS if "q_proj" in name else KV_HEADS
            stored = llama_cpp_permute(values, heads)
            reference = gguf.quants.dequantize(gguf.quants.quantize(stored, qtype), qtype)
            reference = unpermute_rows(reference.reshape(values.shape), heads)
        else:
            reference = gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype)
        assert torch.equal(weights[name], torch.from_numpy(reference.reshape(values.shape)))
        # ...and within the type's rounding error of the original floats.
        error = np.abs(weights[name].numpy() - values)
        bound = QUANTIZATION_ERROR[qtype] * (1 + 1e-5) * _block_scale(values)
        assert (error <= bound).all(), name
        assert error.max() > 0, name  # a real rounding: not the original values


def k_quant_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid K-quant blocks: random bits with finite float16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, blocks.shape[:2]).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:  # ..., d (f16) last
        blocks[..., -2:] = scales.reshape(*blocks.shape[:2], 2)
    else:  # d, dmin (f16) first
        blocks[..., 0:2] = scales.reshape(*blocks.shape[:2], 2)
        blocks[..., 2:4] = scales.reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quants_equal_the_gguf_reference_dequantizer(tmp_path: Path, qtype: Q) -> None:
    rng = np.random.default_rng(1)
    original = hf_tensors()
    blocks = k_quant_blocks(qtype, FFN, 256, rng)  # blocks of 256 values
    raw = {"blk.0.ffn_gate.weight": (blocks, qtype)}
    del original["model.layers.0.mlp.gate_proj.weight"]
    weights = loaded(write_gguf(tmp_path / "m.gguf", original, raw=raw))
    reference = gguf.quants.dequantize(blocks, qtype).reshape(FFN, 256)
    assert np.isfinite(reference).all()
    assert torch.equal(weights["model.layers.0.mlp.gate_proj.weight"], torch.from_numpy(reference))


def test_weights_take_the_engines_dtype(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_tensors())
    weights = dict(iter_gguf_weights(open_gguf(path), torch.bfloat16))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_a_truncated_file_is_refused_by_name(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_tensors())
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 3])
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    for name in ("cut.gguf", "junk.gguf", "missing.gguf"):
        with pytest.raises(GGUFError, match=name.replace(".", r"\.")):
            open_gguf(tmp_path / name)


def test_an_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_tensors(), arch="gpt2")
    with pytest.raises(GGUFError, match="unsupported GGUF architecture 'gpt2'"):
        hf_config(open_gguf(path))


def test_an_unsupported_tensor_type_is_refused_by_name(tmp_path: Path) -> None:
    block_size, type_size = gguf.GGML_QUANT_SIZES[Q.Q2_K]
    blocks = np.zeros((FFN, 256 // block_size * type_size), dtype=np.uint8)
    original = hf_tensors()
    del original["model.layers.0.mlp.gate_proj.weight"]
    raw = {"blk.0.ffn_gate.weight": (blocks, Q.Q2_K)}
    path = write_gguf(tmp_path / "m.gguf", original, raw=raw)
    with pytest.raises(GGUFError, match=r"blk\.0\.ffn_gate\.weight has type Q2_K"):
        loaded(path)


def test_llama3_frequency_factors_are_refused_until_supported(tmp_path: Path) -> None:
    factors = np.ones(HEAD_DIM // 2, dtype=np.float32)
    path = write_gguf(
        tmp_path / "m.gguf", hf_tensors(), raw={"rope_freqs.weight": (factors, Q.F32)}
    )
    with pytest.raises(GGUFError, match="rope_freqs"):
        hf_config(open_gguf(path))
