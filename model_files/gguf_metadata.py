"""A GGUF file's metadata: opening it, its architecture, and its ``config.json``.

Torch-free on purpose: the gateway reads a GGUF model's tokenizer and context window through
this module (with the ``gguf`` package, llama.cpp's own reader), and the gateway never imports
torch. The weights, which need torch, are read by ``backend_engine.model_loader.gguf_weights``.

A file is opened once with :func:`open_gguf` (about 1 s for a 49k-token vocabulary: the reader
parses every metadata array) and the reader is passed to whatever needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# The tensor types ``gguf_weights`` dequantizes (with the gguf package's dequantizer).
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


class GGUFError(ValueError):
    """A GGUF file the engine cannot serve; the message says why."""


class _PlainViewReader(GGUFReader):
    """``GGUFReader`` over a plain ndarray view of its memory map (still mapped, not read).

    The reader slices its ``data`` once per metadata string (about a million slices for a
    49k-token vocabulary with merges), and every slice of an ``np.memmap`` runs
    Python-level hooks: over a plain view the same parse takes a quarter of the time.
    """

    @property  # type: ignore[override]  # a plain view of the map, where the base has the memmap
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._plain_data = mapped.view(np.ndarray)


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def open_gguf(path: str | Path) -> GGUFReader:
    """The file's reader (it maps the file; tensors are read when asked for)."""
    file = Path(path)
    if not file.is_file():
        raise GGUFError(f"no GGUF file at {file}")
    try:
        return _PlainViewReader(file)
    except Exception as exc:  # the reader's struct, numpy and value errors alike
        raise GGUFError(
            f"{file} is not a readable GGUF file (truncated or corrupt?): {exc}"
        ) from None


def check_tensor_types(reader: GGUFReader) -> None:
    """Refuse, by name, the first tensor whose type is not in ``SUPPORTED_TYPES``."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise GGUFError(
                f"tensor {tensor.name} has type {tensor.tensor_type.name}, which is not "
                f"supported; supported: {', '.join(t.name for t in SUPPORTED_TYPES)}"
            )


def architecture(reader: GGUFReader) -> str:
    name = metadata_string(reader, "general.architecture")
    if name not in ARCHITECTURES:
        raise GGUFError(
            f"unsupported GGUF architecture {name!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return name


def hf_config(reader: GGUFReader, *, check_support: bool = True) -> dict[str, Any]:
    """The model's ``config.json``, from the file's metadata.

    ``check_support=False`` maps a model this engine does not run too, as the capacity planner
    does (it reads any decoder's shape): an architecture not in ``ARCHITECTURES`` keeps
    llama.cpp's name, and Llama-3 RoPE frequency factors are left out, not refused.
    """
    if check_support:
        arch = architecture(reader)
        if has_tensor(reader, "rope_freqs.weight"):
            raise GGUFError("Llama-3 RoPE frequency factors (rope_freqs) are not supported yet")
    else:
        arch = metadata_string(reader, "general.architecture")
    hidden_size = metadata_int(reader, f"{arch}.embedding_length")
    num_heads = metadata_int(reader, f"{arch}.attention.head_count")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab_size = (
        metadata_int(reader, f"{arch}.vocab_size")
        if reader.get_field(f"{arch}.vocab_size") is not None
        else len(tokens.data)
        if tokens is not None
        else tensor_rows(reader, "token_embd.weight")
    )
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES.get(arch, arch)],
        "model_type": arch,  # transformers' name for both is llama.cpp's
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": metadata_int(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": metadata_int(reader, f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": metadata_int(reader, f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": metadata_int(reader, f"{arch}.attention.key_length", hidden_size // num_heads),
        "rms_norm_eps": metadata_float(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": metadata_float(reader, f"{arch}.rope.freq_base", 10_000.0),
        "max_position_embeddings": metadata_int(reader, f"{arch}.context_length", 2048),
        "tie_word_embeddings": not has_tensor(reader, "output.weight"),
        "attention_bias": has_tensor(reader, "blk.0.attn_q.bias"),
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None)
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if reader.get_field(f"tokenizer.ggml.{name}") is not None:
            config[key] = metadata_int(reader, f"tokenizer.ggml.{name}")
    return config


def has_tensor(reader: GGUFReader, name: str) -> bool:
    return any(t.name == name for t in reader.tensors)


def tensor_rows(reader: GGUFReader, name: str) -> int:
    for tensor in reader.tensors:
        if tensor.name == name:
            return int(tensor.shape[-1])
    raise GGUFError(f"the GGUF file has no {name} tensor")


def metadata_value(reader: GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise GGUFError(f"the GGUF file's metadata has no {key!r}")
    return field.contents()


def metadata_string(reader: GGUFReader, key: str) -> str:
    value = metadata_value(reader, key)
    if not isinstance(value, str):
        raise GGUFError(f"GGUF metadata {key!r} must be a string, got {value!r}")
    return value


def metadata_int(reader: GGUFReader, key: str, default: int | None = None) -> int:
    if default is not None and reader.get_field(key) is None:
        return default
    value = metadata_value(reader, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(f"GGUF metadata {key!r} must be an integer, got {value!r}")
    return value


def metadata_float(reader: GGUFReader, key: str, default: float) -> float:
    if reader.get_field(key) is None:
        return default
    value = metadata_value(reader, key)
    if not isinstance(value, int | float):
        raise GGUFError(f"GGUF metadata {key!r} must be a number, got {value!r}")
    return float(value)
