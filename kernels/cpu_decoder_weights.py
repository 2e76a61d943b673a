"""What the native decoder (:mod:`kernels.cpu_decoder`) reads, and whether a model's tensors
fit it: its layers' weights and KV caches, its shape, the output projection and the tables
a step from token ids reads (the embedding, the rotary angles). The tensors stay owned by
the model; the decoder only points at them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.cpu_linear import BlockedWeight
from kernels.cpu_quant_linear import GGUFBlockWeight

MAX_SEGMENTS = 3  # decoder_cpu.c's: q, k and v of three types

# A linear as the kernel reads it: oneDNN's packed float32, or row segments of ggml blocks.
LinearWeight = BlockedWeight | tuple[GGUFBlockWeight, ...]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as the kernel reads it (the tensors stay owned by the model)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: LinearWeight  # [q + 2 kv, hidden]
    qkv_bias: torch.Tensor | None  # [q + 2 kv]
    o: LinearWeight  # [hidden, q]
    post_norm: torch.Tensor  # [hidden]
    gate_up: LinearWeight  # [2 intermediate, hidden]: gate rows, then up rows
    down: LinearWeight  # [hidden, intermediate]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor


@dataclass(frozen=True)
class TokenTables:
    """What a step from token ids reads before the layers (``NativeDecoder.decode_run``): the
    embedding ([vocab, hidden]: float32 rows, or a GGUF file's blocks, tiled or not) and the
    rotary table ([max_positions, head_dim]: each position's cos, then sin)."""

    embedding: torch.Tensor | GGUFBlockWeight
    cos_sin: torch.Tensor


@dataclass(frozen=True)
class DecoderShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


def in_features(weight: LinearWeight) -> int:
    return weight.in_features if isinstance(weight, BlockedWeight) else weight[0].in_features


def out_features(weight: LinearWeight) -> int:
    if isinstance(weight, BlockedWeight):
        return weight.out_features
    return sum(segment.out_features for segment in weight)


def tables_fit(tokens: TokenTables, vocab: int, hidden: int, head_dim: int) -> bool:
    """The embedding has the output projection's rows and the hidden width, in a form the
    kernel reads; the rotary table is float32 [positions, head_dim]."""
    embedding, cos_sin = tokens.embedding, tokens.cos_sin
    if isinstance(embedding, GGUFBlockWeight):
        rows_fit = (embedding.out_features, embedding.in_features) == (vocab, hidden)
    else:
        rows_fit = is_plain_float32(embedding) and tuple(embedding.shape) == (vocab, hidden)
    return (
        rows_fit
        and is_plain_float32(cos_sin)
        and cos_sin.dim() == 2
        and cos_sin.shape[1] == head_dim
    )


def fits(layers: Sequence[LayerWeights], final_norm: torch.Tensor, shape: DecoderShape) -> bool:
    """Every layer has the shapes, dtypes and layouts the kernel assumes."""
    hidden = final_norm.shape[0]
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    first = layers[0]
    intermediate = in_features(first.down)
    cache_shape = first.key_cache.shape
    if (
        shape.num_heads % shape.num_kv_heads
        or shape.head_dim % 2
        or len(cache_shape) != 4
        or tuple(cache_shape[2:]) != (shape.num_kv_heads, shape.head_dim)
    ):
        return False

    def is_vector(t: torch.Tensor | None, size: int) -> bool:
        return t is not None and is_plain_float32(t) and tuple(t.shape) == (size,)

    return is_vector(final_norm, hidden) and all(
        is_vector(layer.input_norm, hidden)
        and is_vector(layer.post_norm, hidden)
        and (layer.qkv_bias is None or is_vector(layer.qkv_bias, q + 2 * kv))
        and linear_fits(layer.qkv, q + 2 * kv, hidden)
        and linear_fits(layer.o, hidden, q)
        and linear_fits(layer.gate_up, 2 * intermediate, hidden)
        and linear_fits(layer.down, hidden, intermediate)
        and all(
            (is_plain_float32(cache) or is_plain_int8(cache))
            and cache.dtype == first.key_cache.dtype
            and cache.shape == cache_shape
            for cache in (layer.key_cache, layer.value_cache)
        )
        for layer in layers
    )


def linear_fits(w: LinearWeight, rows: int, columns: int) -> bool:
    """``w`` is a [rows, columns] linear in a form the kernel reads."""
    if isinstance(w, BlockedWeight):
        return (w.out_features, w.in_features) == (rows, columns) and w.k_padded >= columns
    return (
        1 <= len(w) <= MAX_SEGMENTS
        and out_features(w) == rows
        and all(segment.in_features == columns for segment in w)
        and len({segment.tiled for segment in w}) == 1  # all tiled or none
    )


def is_plain_int8(t: torch.Tensor) -> bool:  # an int8 KV cache (kernels/int8_kv_cache.py)
    return t.dtype == torch.int8 and t.device.type == "cpu" and t.is_contiguous()


def is_plain_float32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
