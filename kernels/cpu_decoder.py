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
from functools import cache
from pathlib import Path

import torch

from kernels import cpu_linear
from kernels.cpu_build import load_kernels
from kernels.cpu_decoder_weights import (
    MAX_SEGMENTS,
    DecoderShape,
    LayerWeights,
    LinearWeight,
    TokenTables,
    fits,
    in_features,
    linear_fits,
    out_features,
    tables_fit,
)
from kernels.cpu_linear import BlockedWeight
from kernels.cpu_quant_linear import GGUFBlockWeight
from kernels.int8_kv_cache import block_size_of

__all__ = [  # what the decoder reads, re-exported beside it
    "DecoderShape",
    "LayerWeights",
    "LinearWeight",
    "NativeDecoder",
    "TokenTables",
]

SOURCE = Path(__file__).parent / "csrc" / "decoder_cpu.c"
_ABI_VERSION = 7
_FLOAT32_PACKED = 0  # decoder_cpu.c's segment type for a BlockedWeight
_FLOAT32_ROWS = -1  # decoder_cpu.c's embedding type for a plain float32 table

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
        ("embedding", ctypes.c_void_p),
        ("embedding_type", ctypes.c_int64),
        ("cos_sin", ctypes.c_void_p),
        ("max_positions", ctypes.c_int64),
    ]


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
            "tollway_decode_run": (
                [ctypes.POINTER(_Decoder)]
                + [ctypes.c_void_p] * 4
                + [ctypes.c_int64] * 3
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
        tokens: TokenTables | None = None,
    ) -> None:
        self._library = library
        self.layers = tuple(layers)  # keeps every buffer the structs point at alive
        self.final_norm = final_norm
        self.output = output  # the output projection, when bound: steps can return logits
        self.vocab_size = 0 if output is None else out_features(output)
        self.tokens = tokens  # with the output projection: steps from token ids (decode_run)
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
            **_token_fields(tokens),
        )
        self._decoder_ref = ctypes.byref(self._decoder)

    @classmethod
    def build(
        cls,
        layers: Sequence[LayerWeights],
        final_norm: torch.Tensor,
        shape: DecoderShape,
        output: LinearWeight | None = None,
        tokens: TokenTables | None = None,
    ) -> NativeDecoder | None:
        """The decoder, or ``None`` when the library is unavailable or a tensor does not fit
        (then run the layers one operation at a time). ``output``: the output projection
        ([vocab, hidden]), for steps that return logits; ``tokens``: with it, for decode runs
        from token ids. Either is left out if it does not fit."""
        library = native_library()
        if library is None or not layers or not fits(layers, final_norm, shape):
            return None
        hidden = final_norm.shape[0]
        if output is not None and not linear_fits(output, out_features(output), hidden):
            output = None
        if (
            output is None
            or tokens is None
            or not tables_fit(tokens, out_features(output), hidden, shape.head_dim)
        ):
            tokens = None
        return cls(library, layers, final_norm, shape, output, tokens)

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
        _check_status(status)
        return out if projected is None else projected

    def decode_run(
        self,
        tokens: torch.Tensor,  # [num_seqs] int64: each sequence's last token
        slots: torch.Tensor,  # [num_steps, num_seqs] int64: step j's slot per sequence
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, room for every step
        seq_lens: torch.Tensor,  # [num_steps, num_seqs] int32: step j's context lengths
    ) -> torch.Tensor:  # [num_steps, num_seqs] int64: step j's argmax per sequence
        """Greedy decode steps back to back in one native call, each step from token ids to
        the logits' argmax (NumPy's: the first largest, or the first NaN), fed to the next."""
        if self.tokens is None:
            raise ValueError("this decoder has no embedding and output projection bound")
        num_steps, num_seqs = seq_lens.shape
        if not (
            1 <= num_seqs <= MAX_TOKENS
            and tokens.dtype == slots.dtype == torch.int64
            and block_tables.dtype == seq_lens.dtype == torch.int32
            and tuple(tokens.shape) == (num_seqs,)
            and slots.shape == seq_lens.shape
            and block_tables.dim() == 2
            and block_tables.shape[0] == num_seqs
        ):
            raise ValueError("a decode run takes int64 tokens and slots, int32 tables and lengths")
        slots, seq_lens, block_tables = (t.contiguous() for t in (slots, seq_lens, block_tables))
        chosen = torch.empty((num_steps + 1, num_seqs), dtype=torch.int64)
        chosen[0] = tokens
        logits = torch.empty((num_seqs, self.vocab_size))
        status = self._library.tollway_decode_run(
            self._decoder_ref,
            chosen.data_ptr(),
            slots.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            num_steps,
            num_seqs,
            block_tables.shape[1],
            torch.get_num_threads(),
            logits.data_ptr(),
        )
        _check_status(status)
        return chosen[1:]


def _check_status(status: int) -> None:
    if status == _BAD_TABLES:
        raise ValueError(
            "a block table is shorter than its sequence's context, or it or a slot "
            "lies outside the KV cache"
        )
    if status == _NO_MEMORY:
        raise MemoryError("the native decoder could not allocate its work buffers")
    if status != _OK:
        raise ValueError("the native decoder rejected the step's shapes, a token or a position")


def _token_fields(tokens: TokenTables | None) -> dict[str, int | None]:
    """The decoder struct's embedding and rotary fields (none: zeros)."""
    if tokens is None:
        return {"embedding": None, "embedding_type": 0, "cos_sin": None, "max_positions": 0}
    embedding = tokens.embedding
    if isinstance(embedding, GGUFBlockWeight):
        address, kind = embedding.blocks.data_ptr(), embedding.kernel_type
    else:
        address, kind = embedding.data_ptr(), _FLOAT32_ROWS
    return {
        "embedding": address,
        "embedding_type": kind,
        "cos_sin": tokens.cos_sin.data_ptr(),
        "max_positions": tokens.cos_sin.shape[0],
    }


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
