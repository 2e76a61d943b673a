"""A model's shape for planning: layers, KV heads, head dimension and parameter count.

Read from a Hugging Face directory (``config.json``; parameters counted from the safetensors
headers, else estimated from the config) or a GGUF file (its metadata and tensor infos, and
how its weights are stored: their formats and bytes, `StoredWeights`), or given directly. The
config's keys are read by `model_files` (``ModelConfig.from_dict``, and
``hf_config`` for a GGUF file's metadata) without checking that this engine serves the model:
the planner plans any Llama-style decoder. Nothing here loads a weight or imports torch: a
safetensors file starts with an 8-byte length and a JSON header that lists every tensor's
shape, and the GGUF reader maps its file without reading tensors.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from model_files.model_config import ModelConfig

CONFIG_FILE = "config.json"
_MAX_SAFETENSORS_HEADER = 100 * 2**20
# What a config that is JSON but not a model's config raises, on its way through ModelConfig.
_NOT_A_SHAPE = (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError)


@dataclass(frozen=True)
class StoredWeights:
    """How a checkpoint file stores its weights (a GGUF file's tensor types): the bytes they
    take and each format's share of the parameters, largest first."""

    num_bytes: int
    formats: tuple[tuple[str, float], ...]  # (format, share of the parameters)

    def describe(self, num_params: int) -> str:
        bits = 8 * self.num_bytes / num_params
        shares = ", ".join(f"{name} {share:.0%}" for name, share in self.formats)
        return f"{shares} as stored: {bits:.2f} bits a weight"


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    source: str  # "given", or the checkpoint it was read from
    stored: StoredWeights | None = None  # a GGUF file's own formats (None: not known)

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
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path} is not readable JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} must hold a JSON object")
    raw = raw.get("text_config", raw)  # a multimodal wrapper's language model
    try:
        config = ModelConfig.from_dict(raw, check_support=False)
        num_params = _count_safetensors_params(checkpoint) or estimate_params(config)
        return _shape(config, num_params, source=checkpoint)
    except _NOT_A_SHAPE as exc:
        raise ValueError(f"{config_path} does not describe a model shape: {exc!r}") from None


def estimate_params(config: ModelConfig) -> int:
    """Parameters of a Llama-style decoder from its config: embeddings, attention (with q, k and
    v biases where the config has them, as Qwen2 does by default), gated MLP and norms per
    layer, the final norm, and an output head unless it is tied to the embeddings."""
    hidden, head_dim = config.hidden_size, config.head_dim
    num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
    attention = 2 * hidden * num_heads * head_dim + 2 * hidden * num_kv_heads * head_dim
    mlp = 3 * hidden * config.intermediate_size
    per_layer = attention + mlp + 2 * hidden
    if config.attention_bias:
        per_layer += (num_heads + 2 * num_kv_heads) * head_dim  # q, k and v biases
    heads = 1 if config.tie_word_embeddings else 2
    return heads * config.vocab_size * hidden + config.num_hidden_layers * per_layer + hidden


def _shape(
    config: ModelConfig, num_params: int, *, source: Path, stored: StoredWeights | None = None
) -> ModelShape:
    return ModelShape(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        num_params=num_params,
        source=str(source),
        stored=stored,
    )


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
    from model_files.gguf_metadata import GGUFError, hf_config, open_gguf

    reader = open_gguf(file)  # a GGUFError (a ValueError) naming the file if unreadable
    num_params = sum(int(tensor.n_elements) for tensor in reader.tensors)
    by_format: Counter[str] = Counter()
    for tensor in reader.tensors:
        by_format[tensor.tensor_type.name] += int(tensor.n_elements)
    stored = StoredWeights(
        num_bytes=sum(int(tensor.n_bytes) for tensor in reader.tensors),
        formats=tuple((name, n / num_params) for name, n in by_format.most_common()),
    )
    try:
        config = ModelConfig.from_dict(hf_config(reader, check_support=False), check_support=False)
        return _shape(config, num_params, source=file, stored=stored)
    except GGUFError:
        raise  # the metadata key that is missing or wrong, by name
    except _NOT_A_SHAPE as exc:
        raise ValueError(f"{file} does not describe a model shape: {exc!r}") from None
