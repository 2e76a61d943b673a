"""Linears and embeddings whose weights stay quantized in memory.

Why: a decode step reads every weight once, so its time is the weights' bytes. A GGUF
file's Q4_1 blocks are a seventh of float32; widened at load they cost seven times the
memory traffic. These modules keep what the loader hands them as it is:

- on the CPU, ggml blocks (:class:`~kernels.cpu_quant_linear.GGUFBlockWeight`: a GGUF file's
  Q8_0/Q4_0/Q4_1/..., or a float checkpoint quantized at load into the same blocks), run by
  :mod:`kernels.cpu_quant_linear`;
- on CUDA, the Triton kernels' formats (:class:`~kernels.quantized_weights.Int8Weight`,
  :class:`~kernels.quantized_weights.Int4Weight`), run by :mod:`kernels.triton_quant_linear`.

A fused linear (q/k/v, gate/up) is its shards' rows in order. Shards of one format and type
become one segment; shards that differ (a Q4_K q beside a Q6_K v) stay separate segments,
each its own kernel call into its columns of the output. The whole-step CPU decoder
(:mod:`kernels.cpu_decoder`) reads up to three GGUF segments per linear itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from kernels import cpu_quant_linear, quantized_weights
from kernels.cpu_quant_linear import GGUFBlockWeight
from kernels.huge_pages import copies_on_huge_pages
from kernels.quantized_weights import Int4Weight, Int8Weight

QuantizedTensor = GGUFBlockWeight | Int8Weight | Int4Weight
NATIVE_MAX_SEGMENTS = 3  # kernels.cpu_decoder's limit per linear


def dequantize(weight: QuantizedTensor) -> torch.Tensor:  # [out_features, in_features] float32
    if isinstance(weight, GGUFBlockWeight):
        return cpu_quant_linear.dequantize(weight)
    return quantized_weights.dequantize(weight)


def weight_bytes(weight: QuantizedTensor) -> int:
    """The bytes the weight holds in memory (its blocks, codes, scales and mins)."""
    if isinstance(weight, GGUFBlockWeight):
        return weight.blocks.nbytes
    if isinstance(weight, Int8Weight):
        return weight.qweight.nbytes + weight.scales.nbytes
    return weight.packed.nbytes + weight.scales.nbytes + weight.mins.nbytes


def merge_shards(shards: Sequence[QuantizedTensor]) -> tuple[QuantizedTensor, ...]:
    """Consecutive shards of the same format and type joined row-wise into one segment."""
    segments: list[QuantizedTensor] = []
    for shard in shards:
        previous = segments[-1] if segments else None
        joined = None if previous is None else _joined(previous, shard)
        if joined is None:
            segments.append(shard)
        else:
            segments[-1] = joined
    return tuple(segments)


def _joined(first: QuantizedTensor, second: QuantizedTensor) -> QuantizedTensor | None:
    if first.in_features != second.in_features:
        return None
    if isinstance(first, GGUFBlockWeight) and isinstance(second, GGUFBlockWeight):
        if first.quant_type != second.quant_type or first.tiled or second.tiled:
            return None
        return GGUFBlockWeight.from_blocks(
            torch.cat((first.blocks, second.blocks)), first.quant_type
        )
    if isinstance(first, Int8Weight) and isinstance(second, Int8Weight):
        scales = torch.cat((first.scales, second.scales.to(first.scales.dtype)))
        return Int8Weight(torch.cat((first.qweight, second.qweight)), scales)
    if (
        isinstance(first, Int4Weight)
        and isinstance(second, Int4Weight)
        and first.group_size == second.group_size
    ):
        scales = torch.cat((first.scales, second.scales.to(first.scales.dtype)))
        mins = torch.cat((first.mins, second.mins.to(first.mins.dtype)))
        return Int4Weight(torch.cat((first.packed, second.packed)), scales, mins, first.group_size)
    return None


def _check_same_inputs(segments: Sequence[QuantizedTensor]) -> int:
    if not segments:
        raise ValueError("a quantized linear needs at least one weight")
    in_features = segments[0].in_features
    if any(segment.in_features != in_features for segment in segments):
        raise ValueError("a fused linear's shards must have the same in_features")
    return in_features


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` as quantized row segments (inference only)."""

    def __init__(self, segments: Sequence[QuantizedTensor], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.segments = _tiled_where_possible(merge_shards(segments))
        self.in_features = _check_same_inputs(self.segments)
        self.out_features = sum(segment.out_features for segment in self.segments)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias must be [{self.out_features}], got {tuple(bias.shape)}")
        self.bias = bias
        self._output_columns = [segment.out_features for segment in self.segments]

    @property
    def native_segments(self) -> tuple[GGUFBlockWeight, ...] | None:
        """The segments as :mod:`kernels.cpu_decoder` reads them, or ``None`` when they are
        not all ggml blocks or there are more than it takes."""
        segments = tuple(s for s in self.segments if isinstance(s, GGUFBlockWeight))
        if len(segments) != len(self.segments) or len(segments) > NATIVE_MAX_SEGMENTS:
            return None
        return segments

    def weight_bytes(self) -> int:
        return sum(weight_bytes(segment) for segment in self.segments)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        leading = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        outputs = [_segment_linear(rows, segment) for segment in self.segments]
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*leading, self.out_features)

    def extra_repr(self) -> str:
        kinds = ", ".join(_describe(segment) for segment in self.segments)
        return f"in_features={self.in_features}, out_features={self.out_features}, [{kinds}]"


def _tiled_where_possible(segments: tuple[QuantizedTensor, ...]) -> tuple[QuantizedTensor, ...]:
    """The ggml segments in the CPU kernel's tiles (:mod:`kernels.quant_tiles`, its fastest
    form, in the same bytes) when every one of them can be: the whole-step decoder takes a
    linear's segments all tiled or none."""
    blocks = [s for s in segments if isinstance(s, GGUFBlockWeight)]
    if not blocks or not all(segment.can_tile() for segment in blocks):
        return segments
    return tuple(s.tiled_for_kernel() if isinstance(s, GGUFBlockWeight) else s for s in segments)


def _segment_linear(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    if isinstance(weight, GGUFBlockWeight):  # the CPU kernel takes float32 activations
        return cpu_quant_linear.quantized_linear(x.float().contiguous(), weight).to(x.dtype)
    from kernels import triton_quant_linear  # CUDA only: imports triton

    return triton_quant_linear.quantized_linear(x.contiguous(), weight)


def _describe(weight: QuantizedTensor) -> str:
    if isinstance(weight, GGUFBlockWeight):
        return f"{weight.quant_type.name} x {weight.out_features}"
    if isinstance(weight, Int8Weight):
        return f"int8 x {weight.out_features}"
    return f"int4/{weight.group_size} x {weight.out_features}"


class QuantizedEmbedding(nn.Module):
    """A token embedding table kept in ggml blocks: a step widens only its tokens' rows.
    With tied embeddings the same blocks are the output projection's weight (in its tiles,
    when the output projection tiled them)."""

    def __init__(self, weight: GGUFBlockWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.dtype = dtype
        self.num_embeddings = weight.out_features
        self.embedding_dim = weight.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, embedding_dim]
        return cpu_quant_linear.gathered_rows(self.weight, input_ids).to(self.dtype)

    def weight_bytes(self) -> int:
        return self.weight.blocks.nbytes

    def extra_repr(self) -> str:
        kind = self.weight.quant_type.name
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind} blocks"


def move_blocks_to_huge_pages(model: nn.Module) -> int:
    """Put every GGUF block tensor of ``model``'s quantized linears and embeddings on huge
    pages (:mod:`kernels.huge_pages`: a decode step streams them), in one mapping, replacing
    the weights in place; a tensor shared by several weights (a tied output projection and
    embedding) moves once and stays shared. Returns the bytes moved. Call it before taking
    raw pointers to the weights (the native decoder's)."""
    holders: list[tuple[nn.Module, int | None, GGUFBlockWeight]] = []
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            holders += [
                (module, index, segment)
                for index, segment in enumerate(module.segments)
                if isinstance(segment, GGUFBlockWeight)
            ]
        elif isinstance(module, QuantizedEmbedding):
            holders.append((module, None, module.weight))
    originals = list({id(weight.blocks): weight.blocks for _, _, weight in holders}.values())
    copies = dict(zip(map(id, originals), copies_on_huge_pages(originals), strict=True))
    for module, index, weight in holders:
        moved = replace(weight, blocks=copies[id(weight.blocks)])
        if isinstance(module, QuantizedLinear) and index is not None:
            segments = list(module.segments)
            segments[index] = moved
            module.segments = tuple(segments)
        elif isinstance(module, QuantizedEmbedding):
            module.weight = moved
    return sum(blocks.numel() for blocks in originals)
