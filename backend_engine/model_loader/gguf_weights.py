"""A GGUF file (llama.cpp's format) read as a Hugging Face checkpoint.

The file is read with the ``gguf`` package, llama.cpp's own reader and dequantizer. What it
gives the engine is what a Hugging Face directory gives it:

- ``hf_config``: the metadata (``llama.block_count``, ``llama.rope.freq_base``...) as a
  ``config.json`` dict, which ``ModelConfig.from_dict`` reads as usual;
- ``iter_gguf_weights``: every tensor under its Hugging Face name, dequantized into the
  engine's dtype, or with ``keep_blocks`` its quantized tensors as they are stored
  (:class:`~kernels.cpu_quant_linear.GGUFBlockWeight`, for the types the CPU kernel reads;
  others are still dequantized). llama.cpp's converter permutes the rows of a Llama model's
  q and k projections (so its RoPE can rotate adjacent pairs); that permutation is undone
  here, on whole rows of blocks for quantized ones.

The metadata side (``open_gguf``, ``hf_config``, ``GGUFError``) lives in the torch-free
``gguf_metadata.py`` and is re-exported here. Anything the engine cannot serve exactly is
refused with a :class:`GGUFError` that names it: a file that is truncated or not GGUF, an
architecture other than ``llama`` and ``qwen2``, a tensor type outside ``SUPPORTED_TYPES``,
Llama-3 frequency factors (``rope_freqs``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kernels.cpu_quant_linear import GGUFBlockWeight, GGUFQuantType
from model_files.gguf_metadata import (
    ARCHITECTURES,
    SUPPORTED_TYPES,
    GGUFError,
    architecture,
    check_tensor_types,
    hf_config,
    is_gguf,
    open_gguf,
)

__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_TYPES",
    "GGUFError",
    "architecture",
    "hf_config",
    "hf_name",
    "is_gguf",
    "iter_gguf_weights",
    "iter_gguf_weights_as_stored",
    "open_gguf",
    "unpermute_rows",
]

_PERMUTED_ROPE = {"llama"}  # llama.cpp's converter permutes q/k rows for these

# llama.cpp's tensor names -> Hugging Face's ("{}" is the layer).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


GGUFWeight = torch.Tensor | GGUFBlockWeight


def iter_gguf_weights(
    reader: GGUFReader, dtype: torch.dtype, show_progress: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor under its Hugging Face name, dequantized and converted to ``dtype``."""
    return cast(Iterator[tuple[str, torch.Tensor]], _iter(reader, dtype, show_progress, False))


def iter_gguf_weights_as_stored(
    reader: GGUFReader, dtype: torch.dtype, show_progress: bool = False
) -> Iterator[tuple[str, GGUFWeight]]:
    """Every tensor under its Hugging Face name: a quantized tensor of a type the CPU kernel
    reads stays in its blocks, others are converted to ``dtype``."""
    return _iter(reader, dtype, show_progress, True)


def _iter(
    reader: GGUFReader, dtype: torch.dtype, show_progress: bool, keep_blocks: bool
) -> Iterator[tuple[str, GGUFWeight]]:
    config = hf_config(reader)
    arch = architecture(reader)
    heads = {
        "attn_q": config["num_attention_heads"],
        "attn_k": config["num_key_value_heads"],
    }
    check_tensor_types(reader)
    if not show_progress:
        yield from _converted(reader, arch, heads, dtype, keep_blocks)
        return
    columns = (
        TextColumn("[bold]Loading blocks" if keep_blocks else "[bold]Dequantizing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tensors"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task("weights", total=len(reader.tensors))
        for item in _converted(reader, arch, heads, dtype, keep_blocks):
            yield item
            progress.advance(task)


def hf_name(name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor name."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    block, _, rest = name.partition(".")
    layer, _, suffix = rest.partition(".")
    if block == "blk" and layer.isdigit() and suffix in _LAYER_NAMES:
        return f"model.layers.{layer}.{_LAYER_NAMES[suffix]}"
    raise GGUFError(f"unexpected tensor {name!r} in the GGUF file")


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its ``permute``): within each head, rows
    ``[0, 2, 4, ..., 1, 3, 5, ...]`` become ``[0, 1, 2, ...]`` again. Biases too."""
    shape = weight.shape
    head_dim = shape[0] // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _kept_type(tensor_type: int) -> GGUFQuantType | None:
    try:
        return GGUFQuantType(int(tensor_type))
    except ValueError:
        return None


def _converted(
    reader: GGUFReader,
    arch: str,
    heads: dict[str, int],
    dtype: torch.dtype,
    keep_blocks: bool,
) -> Iterator[tuple[str, GGUFWeight]]:
    for tensor in reader.tensors:
        # A plain ndarray view of the mapped bytes (open_gguf's reader gives one already): the
        # dequantizer slices its input per group of rows, and every slice of a np.memmap runs
        # a Python-level hook.
        data = np.asarray(tensor.data)
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        permuted = arch in _PERMUTED_ROPE and kind in heads
        kept_type = _kept_type(tensor.tensor_type) if keep_blocks else None
        if kept_type is not None and data.ndim == 2:  # [rows, row bytes]
            blocks = unpermute_rows(data, heads[kind]) if permuted else data
            owned = torch.from_numpy(np.array(blocks))  # out of the mapped file
            yield hf_name(tensor.name), GGUFBlockWeight.from_blocks(owned, kept_type)
            continue
        values = dequantize(data, tensor.tensor_type)  # float32 (or the raw floats)
        values = values.reshape([int(n) for n in reversed(tensor.shape)])  # rows first
        if permuted:
            values = unpermute_rows(values, heads[kind])
        if not values.flags.writeable or not values.flags.c_contiguous:
            values = np.array(values)  # a view of the mapped file: the model gets its own copy
        yield hf_name(tensor.name), torch.from_numpy(values).to(dtype)
