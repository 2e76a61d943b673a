"""Quantizing a float checkpoint's weights as they load (``--quantization int8|int4``).

A pure transform of the ``(hf_name, tensor)`` stream the loaders yield: each tensor the
scheme covers comes out quantized, in the format the device's linear reads, everything
else as it came in.

Which tensors (``scheme_for``):

    model.layers.N.self_attn.{q,k,v,o}_proj.weight    the scheme (int8 or int4)
    model.layers.N.mlp.{gate,up,down}_proj.weight      the scheme
    lm_head.weight                                     int8 per output channel, both schemes
    model.embed_tokens.weight                          int8 on the CPU; float on CUDA
    biases, norms, anything else                       float

The output projection stays at 8 bits under int4 because it is the most sensitive matrix
(llama.cpp keeps it at 6 bits or more). On CUDA the embedding is a gather of a few rows a
step, cheap in float; on the CPU it is also the tied output projection of small models.

The rules (one place each, ``kernels.quantized_weights``), with every scale (and int4
minimum) rounded to float16 before the codes are chosen against it, so the stored values
are the ones rounded to:

- int8 per output channel: ``scale = fp16(amax / 127)``, ``q = round(w / scale)`` in
  [-127, 127]; ``|w - q * scale| <= scale / 2``.
- int4 in groups of 32 or 64, asymmetric: ``w ~= code * scale + min``, codes 0..15, the
  float16 pair searched per group for the smallest squared error (min/max rounding and 21
  least-squares refits, :mod:`kernels.int4_quantization`), each code the nearest point of
  the group's grid (round-to-nearest, "rtn").
- int4 with GPTQ, when the caller gives the decoder linears' input Hessians (``hessians``,
  measured by :mod:`backend_engine.models.calibration`): the same format, the codes and each
  group's pair chosen for the smallest error of the layer's *output* on calibration text
  (:mod:`kernels.gptq_quantization`). Round-to-nearest is exact when a float checkpoint's
  weights already lie on a g32 grid (one converted from Q4_1) but must merge two grids into
  one for g64: +24.7% perplexity on SmolLM2-135M, against a few percent with GPTQ
  (docs/benchmarks.md, issue #28).

The formats:

- CPU (``GGUFBlockWeight``, GGUF's blocks of 32): int8 is Q8_0 with every block of a row
  carrying the row's scale; int4 is Q4_1 (float16 scale, float16 minimum, then values ``j``
  and ``j + 16`` of a block sharing a byte), a group of 64 being two blocks with the same
  scale and minimum. Both are exact encodings of the schemes, so ``tollway convert`` writes
  these very blocks into a GGUF file and ``gguf.quants.dequantize`` (the referee) reads the
  values above back.
- CUDA (``Int8Weight`` / ``Int4Weight``, the Triton kernels' formats), float16 scales
  (and mins).

A matrix whose ``in_features`` is not a whole number of blocks (32 on the CPU) or of int4
groups stays float, with one warning naming it: the kernels read whole blocks only, and a
single odd matrix served in float costs less than refusing the model.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Literal

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kernels.cpu_quant_linear import GGUFBlockWeight, GGUFQuantType
from kernels.gptq_quantization import gptq_codes
from kernels.quantized_weights import (
    INT4_GROUP_SIZES,
    Int4Weight,
    Int8Weight,
    int4_codes,
    pack_int4,
    quantize_int8,
)

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int4")
DEVICE_TYPES = ("cpu", "cuda")
BLOCK_VALUES = 32  # values in a Q8_0 or a Q4_1 block (ggml's QK8_0, QK4_1)
SCALE_DTYPE = torch.float16  # the scale GGUF's blocks store; the CUDA formats keep the same
EMBEDDING = "model.embed_tokens.weight"
OUTPUT_PROJECTION = "lm_head.weight"
_DECODER_LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight"
)

Scheme = Literal["int8", "int4"]
LoadedWeight = torch.Tensor | GGUFBlockWeight | Int8Weight | Int4Weight


def scheme_for(name: str, quantization: str, device_type: str) -> Scheme | None:
    """How the tensor ``name`` is stored under ``quantization``; ``None``: float."""
    if _DECODER_LINEAR.fullmatch(name):
        return "int4" if quantization == "int4" else "int8"
    if name == OUTPUT_PROJECTION or (name == EMBEDDING and device_type == "cpu"):
        return "int8"
    return None


def quantize_weights(
    weights: Iterable[tuple[str, LoadedWeight]],
    quantization: str,
    group_size: int,
    device_type: str,
    show_progress: bool = False,
    hessians: Mapping[str, torch.Tensor] | None = None,
) -> Iterator[tuple[str, LoadedWeight]]:
    """``weights`` with each float tensor ``scheme_for`` names quantized for ``device_type``
    (a GGUF file's blocks kept as stored pass through as they are); an int4 tensor named in
    ``hessians`` (its inputs' ``[K, K]`` Hessian) by GPTQ, the others to the nearest."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {DEVICE_TYPES}, got {device_type!r}")
    quantized = (
        (
            name,
            quantize_tensor(
                name, value, quantization, group_size, device_type, (hessians or {}).get(name)
            )
            if isinstance(value, torch.Tensor)
            else value,
        )
        for name, value in weights
    )
    if not show_progress:
        yield from quantized
        return
    columns = (
        TextColumn(f"[bold]Quantizing ({quantization})"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tensors"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task("quantize", total=None)
        for item in quantized:
            yield item
            progress.advance(task)


def quantize_tensor(
    name: str,
    weight: torch.Tensor,
    quantization: str,
    group_size: int,
    device_type: str,
    hessian: torch.Tensor | None = None,  # [K, K]: GPTQ for an int4 tensor
) -> LoadedWeight:
    """One tensor as ``quantize_weights`` yields it."""
    scheme = scheme_for(name, quantization, device_type)
    if scheme is None:
        return weight
    if weight.dim() != 2:
        raise ValueError(f"{name} should be a matrix to quantize, got shape {list(weight.shape)}")
    in_features = int(weight.shape[1])
    unit = group_size if scheme == "int4" else 1  # group sizes are whole blocks
    if device_type == "cpu":
        unit = max(unit, BLOCK_VALUES)
    if in_features % unit:
        logger.warning(
            "%s: in_features %d is not a multiple of %d, so it stays %s (not %s)",
            name,
            in_features,
            unit,
            str(weight.dtype).removeprefix("torch."),
            scheme,
        )
        return weight
    if scheme == "int8":
        int8 = quantize_int8(weight, SCALE_DTYPE)
        return q8_0_blocks(int8) if device_type == "cpu" else int8
    if hessian is None:
        codes, scales, mins = int4_codes(weight, group_size, SCALE_DTYPE)
    else:
        codes, scales, mins = gptq_codes(weight, hessian.to(weight.device), group_size, SCALE_DTYPE)
    if device_type == "cpu":
        return q4_1_blocks(codes, scales, mins)
    return Int4Weight(pack_int4(codes), scales, mins, group_size)


def q8_0_blocks(weight: Int8Weight) -> GGUFBlockWeight:
    """An int8-per-channel weight as Q8_0 blocks: each block its row's float16 scale, then
    its 32 int8 values."""
    num_rows, in_features = weight.out_features, weight.in_features
    scales = weight.scales.to(torch.float16).view(torch.uint8).reshape(num_rows, 1, 2)
    values = weight.qweight.view(torch.uint8).reshape(num_rows, -1, BLOCK_VALUES)
    blocks = torch.cat((scales.expand(num_rows, values.shape[1], 2), values), dim=2)
    return GGUFBlockWeight(blocks.reshape(num_rows, -1), GGUFQuantType.Q8_0, num_rows, in_features)


def q4_1_blocks(
    codes: torch.Tensor,  # [N, K] uint8 in 0..15
    scales: torch.Tensor,  # [N, K // group_size] float16
    mins: torch.Tensor,  # [N, K // group_size] float16
) -> GGUFBlockWeight:
    """int4 codes as Q4_1 blocks (ggml's ``block_q4_1``): a float16 scale, a float16
    minimum, then 16 bytes holding value ``j`` in the low half-byte and value ``j + 16`` in
    the high one. A group of 64 is two blocks with the group's scale and minimum."""
    num_rows, in_features = codes.shape
    num_blocks = in_features // BLOCK_VALUES
    blocks_per_group = num_blocks // scales.shape[1]
    pair = torch.stack((scales.to(torch.float16), mins.to(torch.float16)), dim=2)  # [N, G, 2]
    pair = pair.repeat_interleave(blocks_per_group, dim=1)  # [N, blocks, 2]
    pair_bytes = pair.contiguous().view(torch.uint8).reshape(num_rows, num_blocks, 4)
    halves = codes.reshape(num_rows, num_blocks, 2, BLOCK_VALUES // 2)
    packed = halves[:, :, 0] | (halves[:, :, 1] << 4)  # [N, blocks, 16]
    blocks = torch.cat((pair_bytes, packed), dim=2).reshape(num_rows, -1)
    return GGUFBlockWeight(blocks, GGUFQuantType.Q4_1, int(num_rows), int(in_features))
