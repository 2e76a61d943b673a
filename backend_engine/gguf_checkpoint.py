"""A GGUF file (llama.cpp's format) read as a Hugging Face checkpoint.

The file is read with the ``gguf`` package, llama.cpp's own reader and dequantizer. What it
gives the engine is what a Hugging Face directory gives it:

- ``hf_config``: the metadata (``llama.block_count``, ``llama.rope.freq_base``...) as a
  ``config.json`` dict, which ``ModelConfig.from_dict`` reads as usual;
- ``iter_gguf_weights``: every tensor under its Hugging Face name, dequantized into the
  engine's dtype. llama.cpp's converter permutes the rows of a Llama model's q and k
  projections (so its RoPE can rotate adjacent pairs); that permutation is undone here.

Anything the engine cannot serve exactly is refused with a :class:`GGUFError` that names it:
a file that is truncated or not GGUF, an architecture other than ``llama`` and ``qwen2``, a
tensor type outside ``SUPPORTED_TYPES``, Llama-3 frequency factors (``rope_freqs``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

SUPPORTED_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
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


class GGUFError(ValueError):
    """A GGUF file the engine cannot serve; the message says why."""


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def open_gguf(path: str | Path) -> GGUFReader:
    """The file's reader (it maps the file; tensors are read when asked for)."""
    file = Path(path)
    if not file.is_file():
        raise GGUFError(f"no GGUF file at {file}")
    try:
        return GGUFReader(file)
    except Exception as exc:  # the reader's struct, numpy and value errors alike
        raise GGUFError(
            f"{file} is not a readable GGUF file (truncated or corrupt?): {exc}"
        ) from None


def architecture(reader: GGUFReader) -> str:
    name = _string(reader, "general.architecture")
    if name not in ARCHITECTURES:
        raise GGUFError(
            f"unsupported GGUF architecture {name!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return name


def hf_config(reader: GGUFReader) -> dict[str, Any]:
    """The model's ``config.json``, from the file's metadata."""
    arch = architecture(reader)
    if _has_tensor(reader, "rope_freqs.weight"):
        raise GGUFError("Llama-3 RoPE frequency factors (rope_freqs) are not supported yet")
    hidden_size = _int(reader, f"{arch}.embedding_length")
    num_heads = _int(reader, f"{arch}.attention.head_count")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab_size = (
        _int(reader, f"{arch}.vocab_size")
        if reader.get_field(f"{arch}.vocab_size") is not None
        else len(tokens.data)
        if tokens is not None
        else _tensor_rows(reader, "token_embd.weight")
    )
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": _int(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _int(reader, f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _int(reader, f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": _int(reader, f"{arch}.attention.key_length", hidden_size // num_heads),
        "rms_norm_eps": _float(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _float(reader, f"{arch}.rope.freq_base", 10_000.0),
        "max_position_embeddings": _int(reader, f"{arch}.context_length", 2048),
        "tie_word_embeddings": not _has_tensor(reader, "output.weight"),
        "attention_bias": _has_tensor(reader, "blk.0.attn_q.bias"),
        "torch_dtype": "float32",
    }
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if reader.get_field(f"tokenizer.ggml.{name}") is not None:
            config[key] = _int(reader, f"tokenizer.ggml.{name}")
    return config


def iter_gguf_weights(
    reader: GGUFReader, dtype: torch.dtype, show_progress: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor under its Hugging Face name, dequantized and converted to ``dtype``."""
    config = hf_config(reader)
    arch = architecture(reader)
    heads = {
        "attn_q": config["num_attention_heads"],
        "attn_k": config["num_key_value_heads"],
    }
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise GGUFError(
                f"tensor {tensor.name} has type {tensor.tensor_type.name}, which is not "
                f"supported; supported: {', '.join(t.name for t in SUPPORTED_TYPES)}"
            )
    if not show_progress:
        yield from _converted(reader, arch, heads, dtype)
        return
    columns = (
        TextColumn("[bold]Dequantizing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tensors"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task("weights", total=len(reader.tensors))
        for item in _converted(reader, arch, heads, dtype):
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


def _converted(
    reader: GGUFReader, arch: str, heads: dict[str, int], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type)  # float32 (or the raw floats)
        values = values.reshape([int(n) for n in reversed(tensor.shape)])  # rows first
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if arch in _PERMUTED_ROPE and kind in heads:
            values = unpermute_rows(values, heads[kind])
        if not values.flags.writeable or not values.flags.c_contiguous:
            values = np.array(values)  # a view of the mapped file: the model gets its own copy
        yield hf_name(tensor.name), torch.from_numpy(values).to(dtype)


def _has_tensor(reader: GGUFReader, name: str) -> bool:
    return any(t.name == name for t in reader.tensors)


def _tensor_rows(reader: GGUFReader, name: str) -> int:
    for tensor in reader.tensors:
        if tensor.name == name:
            return int(tensor.shape[-1])
    raise GGUFError(f"the GGUF file has no {name} tensor")


def _value(reader: GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise GGUFError(f"the GGUF file's metadata has no {key!r}")
    return field.contents()


def _string(reader: GGUFReader, key: str) -> str:
    value = _value(reader, key)
    if not isinstance(value, str):
        raise GGUFError(f"GGUF metadata {key!r} must be a string, got {value!r}")
    return value


def _int(reader: GGUFReader, key: str, default: int | None = None) -> int:
    if default is not None and reader.get_field(key) is None:
        return default
    value = _value(reader, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(f"GGUF metadata {key!r} must be an integer, got {value!r}")
    return value


def _float(reader: GGUFReader, key: str, default: float) -> float:
    if reader.get_field(key) is None:
        return default
    value = _value(reader, key)
    if not isinstance(value, int | float):
        raise GGUFError(f"GGUF metadata {key!r} must be a number, got {value!r}")
    return float(value)
