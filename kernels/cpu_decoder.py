"""Every decoder layer of a decode-only step in one native call (float32, CPU).

Why: one sequence's decode step should cost one pass over the weights. Layer by layer
from Python, SmolLM2-135M's 30 thin layers spend ~10 ms per step on the small operations
between the matmuls (norms, rotary, the KV store, attention, SiLU: each a dispatch, some
checks and an OpenMP fork) on top of ~25 ms of matmuls, on the 2-core development machine.
``kernels/csrc/decoder_cpu.c`` runs the whole stack in one OpenMP region, from the
embeddings to the final norm, reusing the one-operation kernels' code (so each stage gives
the same bits); ``python -m bench.single_stream_decode`` measures the result.

What it takes: a Llama-family stack (RMSNorm, fused q/k/v with optional bias, rotary,
grouped-query paged attention, SwiGLU) whose four linears per layer each run either the
native small-batch kernel (:mod:`kernels.cpu_linear`, reading oneDNN's packed buffers in
place) or the quantized one over a GGUF file's blocks as stored
(:mod:`kernels.cpu_quant_linear`, INT8_ACTIVATIONS, the same code and bits as a one-linear
call; a fused linear whose shards differ in type runs as up to three row segments),
float32 KV caches, and a step of at most :data:`MAX_TOKENS` sequences, each decoding one
token. :meth:`NativeDecoder.build` returns ``None`` when the library cannot be built or
loaded (``TOLLWAY_CPU_KERNELS=reference``, no compiler) or a tensor does not fit; callers
then run the layers one operation at a time.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from kernels import cpu_linear
from kernels.cpu_build import load_kernels
from kernels.cpu_linear import BlockedWeight
from kernels.cpu_quant_linear import GGUFBlockWeight
from kernels.int8_kv_cache import block_size_of

SOURCE = Path(__file__).parent / "csrc" / "decoder_cpu.c"
_ABI_VERSION = 5
MAX_SEGMENTS = 3  # decoder_cpu.c's: q, k and v of three types
_FLOAT32_PACKED = 0  # decoder_cpu.c's segment type for a BlockedWeight

# A linear as the kernel reads it: oneDNN's packed float32, or row segments of ggml blocks.
LinearWeight = BlockedWeight | tuple[GGUFBlockWeight, ...]
MAX_TOKENS = cpu_linear.MAX_ROWS  # the linears' native limit (the library agrees at load)
_OK, _BAD_ARGUMENTS, _BAD_TABLES, _NO_MEMORY = 0, 1, 2, 3
_FLOAT32_CACHE, _INT8_CACHE = 0, 2  # paged_attention.h's DTYPE_FLOAT32 and DTYPE_INT8


class _Segment(ctypes.Structure):  # decoder_cpu.c's WeightSegment
    _fields_ = [("data", ctypes.c_void_p), ("type", ctypes.c_int64), ("rows", ctypes.c_int64)]


class _Linear(ctypes.Structure):  # decoder_cpu.c's DecoderLinear
    _fields_ = [
        ("segments", _Segment * MAX_SEGMENTS),
        ("num_segments", ctypes.c_int64),
        ("k_padded", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):  # decoder_cpu.c's DecoderLayer
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("input_norm", "qkv_bias", "post_norm")),
        *((name, _Linear) for name in ("qkv", "o", "gate_up", "down")),
        *((name, ctypes.c_void_p) for name in ("key_cache", "value_cache")),
    ]


class _Decoder(ctypes.Structure):  # decoder_cpu.c's Decoder
    _fields_ = [
        *(
            (name, ctypes.c_int64)
            for name in (
                "num_layers",
                "hidden",
                "intermediate",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "num_blocks",
                "block_size",
                "cache_dtype",
            )
        ),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layers", ctypes.POINTER(_Layer)),
        ("final_norm", ctypes.c_void_p),
        ("output", _Linear),
        ("vocab", ctypes.c_int64),
    ]


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
class DecoderShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


@cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernel, or ``None`` when native kernels are off or cannot be built."""
    library = load_kernels(
        SOURCE,
        "decode steps run one operation at a time",
        ("tollway_decoder_abi_version", _ABI_VERSION),
        {
            "tollway_decode_layers": (
                [ctypes.POINTER(_Decoder)]
                + [ctypes.c_void_p] * 7
                + [ctypes.c_int64] * 2
                + [ctypes.c_int, ctypes.c_void_p],
                ctypes.c_int,
            ),
            "tollway_decoder_layer_size": ([], ctypes.c_int64),
            "tollway_decoder_size": ([], ctypes.c_int64),
            "tollway_decoder_max_rows": ([], ctypes.c_int),
        },
    )
    if library is None:
        return None
    agrees = (
        library.tollway_decoder_layer_size() == ctypes.sizeof(_Layer)
        and library.tollway_decoder_size() == ctypes.sizeof(_Decoder)
        and library.tollway_decoder_max_rows() == MAX_TOKENS
    )
    return library if agrees else None


class NativeDecoder:
    """The decoder layers of one model, bound to its KV caches, as one native call."""

    def __init__(
        self,
        library: ctypes.CDLL,
        layers: Sequence[LayerWeights],
        final_norm: torch.Tensor,
        shape: DecoderShape,
        output: LinearWeight | None = None,
    ) -> None:
        self._library = library
        self.layers = tuple(layers)  # keeps every buffer the structs point at alive
        self.final_norm = final_norm
        self.output = output  # the output projection, when bound: steps can return logits
        self.vocab_size = 0 if output is None else out_features(output)
        self.hidden_size = final_norm.shape[0]
        self._head_dim = shape.head_dim
        first = self.layers[0]
        num_blocks, block_size = first.key_cache.shape[0], block_size_of(first.key_cache)
        self._layer_structs = (_Layer * len(self.layers))(*map(_layer_struct, self.layers))
        self._decoder = _Decoder(
            num_layers=len(self.layers),
            hidden=self.hidden_size,
            intermediate=in_features(first.down),
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            cache_dtype=_INT8_CACHE if first.key_cache.dtype == torch.int8 else _FLOAT32_CACHE,
            eps=shape.eps,
            scale=shape.head_dim**-0.5,
            layers=self._layer_structs,
            final_norm=final_norm.data_ptr(),
            output=_Linear() if output is None else _linear_struct(output),
            vocab=self.vocab_size,
        )
        self._decoder_ref = ctypes.byref(self._decoder)

    @classmethod
    def build(
        cls,
        layers: Sequence[LayerWeights],
        final_norm: torch.Tensor,
        shape: DecoderShape,
        output: LinearWeight | None = None,
    ) -> NativeDecoder | None:
        """The decoder, or ``None`` when the library is unavailable or a tensor does not fit
        (then run the layers one operation at a time). ``output``: the output projection
        ([vocab, hidden]), for steps that return logits; left out if it does not fit."""
        library = native_library()
        if library is None or not layers or not _fits(layers, final_norm, shape):
            return None
        hidden = final_norm.shape[0]
        if output is not None and not _linear_is(output, out_features(output), hidden):
            output = None
        return cls(library, layers, final_norm, shape, output)

    def __call__(
        self,
        hidden: torch.Tensor,  # [num_seqs, hidden]: the new tokens' embeddings
        cos: torch.Tensor,  # [num_seqs, 1, head_dim // 2]
        sin: torch.Tensor,  # [num_seqs, 1, head_dim // 2]
        slot_mapping: torch.Tensor,  # [num_seqs] int64
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. the new token
        logits: bool = False,
    ) -> torch.Tensor:  # [num_seqs, hidden] after the final norm, or [num_seqs, vocab]
        """Run every layer for one decode token per sequence: the keys and values go into
        their slots, and the last layer's output comes back normalised; with ``logits`` (an
        output projection bound), projected onto the vocabulary in the same native call."""
        if logits and self.output is None:
            raise ValueError("this decoder has no output projection bound")
        num_seqs = hidden.shape[0]
        if not 1 <= num_seqs <= MAX_TOKENS:
            raise ValueError(
                f"the native decoder takes 1 to {MAX_TOKENS} sequences, not {num_seqs}"
            )
        half = self._head_dim // 2
        hidden = hidden.contiguous()
        cos = cos.reshape(num_seqs, half).contiguous()
        sin = sin.reshape(num_seqs, half).contiguous()
        block_tables = block_tables.contiguous()
        _check_step(hidden, cos, slot_mapping, block_tables, seq_lens, self.hidden_size)
        out = torch.empty_like(hidden)
        projected = torch.empty((num_seqs, self.vocab_size)) if logits else None
        status = self._library.tollway_decode_layers(
            self._decoder_ref,
            hidden.data_ptr(),
            out.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slot_mapping.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            num_seqs,
            block_tables.shape[1],
            torch.get_num_threads(),
            None if projected is None else projected.data_ptr(),
        )
        if status == _BAD_TABLES:
            raise ValueError(
                "a block table is shorter than its sequence's context, or it or a slot "
                "lies outside the KV cache"
            )
        if status == _NO_MEMORY:
            raise MemoryError("the native decoder could not allocate its work buffers")
        if status != _OK:
            raise ValueError("the native decoder rejected the step's shapes")
        return out if projected is None else projected


def in_features(weight: LinearWeight) -> int:
    return weight.in_features if isinstance(weight, BlockedWeight) else weight[0].in_features


def out_features(weight: LinearWeight) -> int:
    if isinstance(weight, BlockedWeight):
        return weight.out_features
    return sum(segment.out_features for segment in weight)


def _linear_struct(weight: LinearWeight) -> _Linear:
    if isinstance(weight, BlockedWeight):
        segment = _Segment(weight.address, _FLOAT32_PACKED, weight.out_features)
        return _Linear((_Segment * MAX_SEGMENTS)(segment), 1, weight.k_padded)
    segments = [
        _Segment(segment.blocks.data_ptr(), segment.kernel_type, segment.out_features)
        for segment in weight
    ]
    return _Linear((_Segment * MAX_SEGMENTS)(*segments), len(segments), weight[0].in_features)


def _layer_struct(layer: LayerWeights) -> _Layer:
    bias = layer.qkv_bias
    return _Layer(
        input_norm=layer.input_norm.data_ptr(),
        qkv_bias=None if bias is None else bias.data_ptr(),
        post_norm=layer.post_norm.data_ptr(),
        qkv=_linear_struct(layer.qkv),
        o=_linear_struct(layer.o),
        gate_up=_linear_struct(layer.gate_up),
        down=_linear_struct(layer.down),
        key_cache=layer.key_cache.data_ptr(),
        value_cache=layer.value_cache.data_ptr(),
    )


def _fits(layers: Sequence[LayerWeights], final_norm: torch.Tensor, shape: DecoderShape) -> bool:
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
        return t is not None and _is_plain_float32(t) and tuple(t.shape) == (size,)

    return is_vector(final_norm, hidden) and all(
        is_vector(layer.input_norm, hidden)
        and is_vector(layer.post_norm, hidden)
        and (layer.qkv_bias is None or is_vector(layer.qkv_bias, q + 2 * kv))
        and _linear_is(layer.qkv, q + 2 * kv, hidden)
        and _linear_is(layer.o, hidden, q)
        and _linear_is(layer.gate_up, 2 * intermediate, hidden)
        and _linear_is(layer.down, hidden, intermediate)
        and all(
            (_is_plain_float32(cache) or _is_plain_int8(cache))
            and cache.dtype == first.key_cache.dtype
            and cache.shape == cache_shape
            for cache in (layer.key_cache, layer.value_cache)
        )
        for layer in layers
    )


def _linear_is(w: LinearWeight, rows: int, columns: int) -> bool:
    """``w`` is a [rows, columns] linear in a form the kernel reads."""
    if isinstance(w, BlockedWeight):
        return (w.out_features, w.in_features) == (rows, columns) and w.k_padded >= columns
    return (
        1 <= len(w) <= MAX_SEGMENTS
        and out_features(w) == rows
        and all(segment.in_features == columns for segment in w)
        and len({segment.tiled for segment in w}) == 1  # all tiled or none
    )


def _is_plain_int8(t: torch.Tensor) -> bool:  # an int8 KV cache (kernels/int8_kv_cache.py)
    return t.dtype == torch.int8 and t.device.type == "cpu" and t.is_contiguous()


def _is_plain_float32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _check_step(
    hidden: torch.Tensor,
    cos: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    hidden_size: int,
) -> None:
    num_seqs = hidden.shape[0]
    if not (
        hidden.dtype == cos.dtype == torch.float32
        and hidden.shape == (num_seqs, hidden_size)
        and slot_mapping.dtype == torch.int64
        and block_tables.dtype == seq_lens.dtype == torch.int32
        and slot_mapping.shape == seq_lens.shape == (num_seqs,)
        and block_tables.dim() == 2
        and block_tables.shape[0] == num_seqs
        and slot_mapping.is_contiguous()
        and seq_lens.is_contiguous()
    ):
        raise ValueError("the native decoder takes float32 activations and int metadata")
