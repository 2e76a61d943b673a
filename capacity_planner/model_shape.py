"""A model's shape for planning: layers, KV heads, head dimension and parameter count.

Read from a Hugging Face directory (``config.json``; parameters counted from the safetensors
headers, else estimated from the config) or a GGUF file (its metadata and tensor infos), or
given directly. Nothing here loads a weight or imports torch: a safetensors file starts with
an 8-byte length and a JSON header that lists every tensor's shape, and the GGUF reader maps
its file without reading tensors.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
_MAX_SAFETENSORS_HEADER = 100 * 2**20


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    source: str  # "given", or the checkpoint it was read from

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "num_params"):
            value = getattr(self, field)
            if not value > 0:
                flag = {
                    "num_layers": "layers",
                    "num_kv_heads": "kv_heads",
                    "num_params": "params",
                }.get(field, field)
                raise ValueError(f"--{flag.replace('_', '-')} must be greater than 0, got {value}")


def shape_from_checkpoint(path: str | Path) -> ModelShape:
    """The shape of a Hugging Face directory or a ``.gguf`` file; `ValueError` if unreadable."""
    checkpoint = Path(path)
    if checkpoint.suffix.lower() == ".gguf":
        return _shape_from_gguf(checkpoint)
    config_path = checkpoint / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(
            f"no checkpoint at {checkpoint}: expected a Hugging Face directory with "
            f"{CONFIG_FILE} or a .gguf file"
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object")
    config = config.get("text_config", config)  # a multimodal wrapper's language model
    try:
        num_heads = int(config["num_attention_heads"])
        hidden_size = int(config["hidden_size"])
        return ModelShape(
            num_layers=int(config["num_hidden_layers"]),
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            num_params=_count_safetensors_params(checkpoint) or estimate_params(config),
            source=str(checkpoint),
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"{config_path} does not describe a model shape: {exc!r}") from None


def estimate_params(config: dict[str, Any]) -> int:
    """Parameters of a Llama-style decoder from its config: embeddings, attention (with q, k and
    v biases where the config has them, as Qwen2 does by default), gated MLP and norms per
    layer, the final norm, and an output head unless it is tied to the embeddings."""
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    head_dim = int(config.get("head_dim") or hidden // num_heads)
    vocab = int(config["vocab_size"])
    attention = 2 * hidden * num_heads * head_dim + 2 * hidden * num_kv_heads * head_dim
    mlp = 3 * hidden * int(config["intermediate_size"])
    per_layer = attention + mlp + 2 * hidden
    architectures = config.get("architectures") or []
    if config.get("attention_bias", "Qwen2ForCausalLM" in architectures):
        per_layer += (num_heads + 2 * num_kv_heads) * head_dim  # q, k and v biases
    heads = 1 if config.get("tie_word_embeddings", False) else 2
    return heads * vocab * hidden + int(config["num_hidden_layers"]) * per_layer + hidden


def _count_safetensors_params(directory: Path) -> int:
    """Elements in every tensor of the directory's safetensors files (0 when there are none)."""
    total = 0
    for file in sorted(directory.glob("*.safetensors")):
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_SAFETENSORS_HEADER:
                raise ValueError(f"{file} has a {length}-byte header: not a safetensors file")
            header = json.loads(f.read(length))
        total += sum(
            math.prod(info["shape"]) for name, info in header.items() if name != "__metadata__"
        )
    return total


def _shape_from_gguf(file: Path) -> ModelShape:
    from model_files.gguf_metadata import metadata_int, metadata_string, open_gguf

    reader = open_gguf(file)  # a GGUFError (a ValueError) naming the file if unreadable
    arch = metadata_string(reader, "general.architecture")
    num_heads = metadata_int(reader, f"{arch}.attention.head_count")
    hidden_size = metadata_int(reader, f"{arch}.embedding_length")
    return ModelShape(
        num_layers=metadata_int(reader, f"{arch}.block_count"),
        num_kv_heads=metadata_int(reader, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=metadata_int(reader, f"{arch}.attention.key_length", hidden_size // num_heads),
        num_params=sum(int(tensor.n_elements) for tensor in reader.tensors),
        source=str(file),
    )
