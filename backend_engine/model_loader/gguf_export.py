"""``tollway convert SRC OUT.gguf``: a GGUF file from a GGUF file or a Hugging Face directory,
float or quantized (``--quantization int8|int4``).

What it writes, as llama.cpp's converter lays a file out (so llama.cpp, transformers and our
own loader read it):

    metadata     general.*, and what ``hf_config`` reads: {arch}.block_count,
                 context_length, embedding_length, feed_forward_length, head_count(_kv),
                 key/value_length, layer_norm_rms_epsilon, rope.freq_base, vocab_size
    tokenizer    a GGUF source's ``tokenizer.*`` fields copied; a Hugging Face tokenizer.json
                 converted (``gguf_tokenizer_export``)
    tensors      llama.cpp's names; a Llama model's q/k rows permuted as its converter does
                 (``permute_rows``, the inverse of ``gguf_weights.unpermute_rows``); norms
                 and biases F32; the matrices in ``--dtype`` (F32, F16, BF16) or, quantized,
                 in the blocks ``weight_quantization`` makes for the CPU: int8 per output
                 channel as Q8_0, int4 groups as Q4_1 (both exact encodings of the schemes,
                 so llama.cpp reads them as they are), the output projection and the
                 embedding int8; int4 codes by GPTQ when the caller passes ``calibrate``
                 (the command line runs the float model on calibration text,
                 ``backend_engine.models.calibration``), else rounded to the nearest

A GGUF source is dequantized first (quantized again if asked). The file is written next to
``OUT`` and renamed into place once whole, and everything the tokenizer and config need is
checked before, so a source that cannot be converted leaves no file behind. Refused, with a
``GGUFError`` naming why: architectures other than Llama and Qwen2, RoPE scaling,
sliding-window attention, activations other than SiLU, MLP biases, tokenizers that are not
byte-level BPE (see ``gguf_tokenizer_export``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.quants import quantize as gguf_quantize

from backend_engine.model_loader.gguf_tokenizer_export import (
    copy_tokenizer_fields,
    vocabulary_from_hf,
    write_vocabulary,
)
from backend_engine.model_loader.gguf_weights import iter_gguf_weights
from backend_engine.model_loader.weight_quantization import LoadedWeight, quantize_weights
from backend_engine.model_loader.weights import iter_weights
from kernels.cpu_quant_linear import GGUFBlockWeight
from kernels.quantized_weights import INT4_GROUP_SIZES
from model_files.gguf_metadata import ARCHITECTURES, GGUFError, hf_config, is_gguf, open_gguf
from model_files.gguf_tokenizer import GGUFVocabulary, read_vocabulary
from model_files.model_config import ModelConfig

FLOAT_TYPES = {
    "float32": GGMLQuantizationType.F32,
    "float16": GGMLQuantizationType.F16,
    "bfloat16": GGMLQuantizationType.BF16,
}
QUANTIZATIONS = ("int8", "int4")
FILE_TYPES = {
    "float32": LlamaFileType.ALL_F32,
    "float16": LlamaFileType.MOSTLY_F16,
    "bfloat16": LlamaFileType.MOSTLY_BF16,
    "int8": LlamaFileType.MOSTLY_Q8_0,
    "int4": LlamaFileType.MOSTLY_Q4_1,
}
_GGUF_ARCHITECTURES = {hf: arch for arch, hf in ARCHITECTURES.items()}
_PERMUTED_ROPE = {"llama"}  # llama.cpp's converter permutes q/k rows for these

# Hugging Face names -> llama.cpp's ("{}" is the layer); gguf_weights.hf_name is the inverse.
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some checkpoints save; not weights


def convert_to_gguf(
    source: str | Path,
    out_file: str | Path,
    *,
    dtype: str = "float32",
    quantization: str | None = None,
    group_size: int = 32,
    overwrite: bool = False,
    show_progress: bool = False,
    calibrate: Callable[[], Mapping[str, torch.Tensor]] | None = None,
) -> Path:
    """Write ``source`` (a ``.gguf`` file or a Hugging Face directory) as the GGUF file
    ``out_file``; returns its path. ``GGUFError`` for a source that cannot be converted,
    ``ValueError`` for bad settings or an existing ``out_file`` (unless ``overwrite``).
    ``calibrate`` (called once the source is known to convert, under int4 only) gives the
    decoder linears' input Hessians for GPTQ."""
    if dtype not in FLOAT_TYPES:
        raise ValueError(f"dtype must be one of {', '.join(FLOAT_TYPES)}, got {dtype!r}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be int8 or int4, got {quantization!r}")
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group size must be 32 or 64, got {group_size}")
    target = Path(out_file)
    if target.suffix.lower() != ".gguf":
        raise ValueError(f"{target} must end in .gguf")
    if target.is_dir() or (target.exists() and not overwrite):
        raise ValueError(f"{target} exists (--force replaces a file)")
    src = Path(source)
    add_tokenizer: Callable[[GGUFWriter], None]
    if is_gguf(src):
        reader = open_gguf(src)
        config = _convertible(hf_config(reader), src)
        read_vocabulary(reader)  # refused here, not after the weights, if it cannot be read
        add_tokenizer = partial(copy_tokenizer_fields, reader)
        weights = iter_gguf_weights(reader, torch.float32, show_progress)
    else:
        config = _convertible(_read_config(src), src)
        vocabulary = vocabulary_from_hf(src, config.vocab_size)
        add_tokenizer = partial(_write_vocabulary, vocabulary)
        weights = iter_weights(src, torch.float32, show_progress)
    arch = _GGUF_ARCHITECTURES[config.architecture]
    unfinished = target.with_name(f".{target.name}.partial")
    writer = GGUFWriter(unfinished, arch, use_temp_file=True)
    try:
        writer.add_name(src.stem if is_gguf(src) else src.resolve().name)
        writer.add_file_type(FILE_TYPES[quantization or dtype])
        if quantization is not None:
            writer.add_quantization_version(GGML_QUANT_VERSION)
        _add_model_metadata(writer, config)
        add_tokenizer(writer)
        if quantization is not None:
            hessians = calibrate() if calibrate is not None and quantization == "int4" else None
            stream: Iterator[tuple[str, LoadedWeight]] = quantize_weights(
                weights, quantization, group_size, "cpu", show_progress, hessians
            )
        else:
            stream = iter(weights)
        _add_tensors(writer, stream, config, arch, FLOAT_TYPES[dtype])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(unfinished, target)
    finally:
        writer.close()
        unfinished.unlink(missing_ok=True)
    return target


def gguf_name(name: str) -> str:
    """llama.cpp's name for a Hugging Face tensor name."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    layer, _, suffix = name.removeprefix("model.layers.").partition(".")
    if name.startswith("model.layers.") and layer.isdigit() and suffix in _LAYER_NAMES:
        return f"blk.{layer}.{_LAYER_NAMES[suffix]}"
    raise GGUFError(f"tensor {name!r} has no llama.cpp name (an unsupported layer?)")


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (its converter's ``permute``): within each head, rows
    ``[0, 1, 2, ...]`` become ``[0, 2, 4, ..., 1, 3, 5, ...]``; the inverse of
    ``gguf_weights.unpermute_rows``. Rows of quantized blocks too: each row is its own."""
    shape = weight.shape
    head_dim = shape[0] // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _write_vocabulary(vocabulary: GGUFVocabulary, writer: GGUFWriter) -> None:
    write_vocabulary(writer, vocabulary)


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not directory.is_dir() or not path.is_file():
        raise GGUFError(f"{directory} is neither a .gguf file nor a directory with config.json")
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise GGUFError(f"{path} must hold a JSON object")
    return data


def _convertible(raw: dict[str, Any], source: Path) -> ModelConfig:
    """The parsed config, refused where GGUF (as ``hf_config`` reads it) cannot say it."""
    try:
        config = ModelConfig.from_dict(raw)
    except (KeyError, ValueError) as exc:
        raise GGUFError(f"{source}: {exc}") from None
    problems = []
    if config.architecture not in _GGUF_ARCHITECTURES:
        problems.append(f"the {config.architecture} architecture")
    if config.rope_scaling is not None:
        problems.append(f"{config.rope_scaling.get('rope_type')} RoPE scaling")
    if config.sliding_window is not None:
        problems.append("sliding-window attention")
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"the {raw['hidden_act']} activation")
    if raw.get("mlp_bias"):
        problems.append("MLP biases")
    if problems:
        raise GGUFError(f"{source} cannot be written as GGUF: {', '.join(problems)}")
    return config


def _add_model_metadata(writer: GGUFWriter, config: ModelConfig) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)


def _add_tensors(
    writer: GGUFWriter,
    weights: Iterator[tuple[str, LoadedWeight]],
    config: ModelConfig,
    arch: str,
    float_type: GGMLQuantizationType,
) -> None:
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    has_output = False
    for name, value in weights:
        if name.endswith(_SKIPPED_SUFFIXES):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: llama.cpp uses token_embd, and hf_config says tied without output
        has_output = has_output or name == "lm_head.weight"
        target = gguf_name(name)
        kind = target.split(".")[2] if target.startswith("blk.") else ""
        if isinstance(value, GGUFBlockWeight):
            data = value.in_file_layout().blocks.numpy()
            qtype = GGMLQuantizationType(int(value.quant_type))
        elif isinstance(value, torch.Tensor):
            data = value.float().numpy()
            qtype = float_type if data.ndim == 2 else GGMLQuantizationType.F32
        else:  # the CUDA formats: quantize_weights is asked for the CPU's
            raise TypeError(f"{name}: {type(value).__name__} cannot be written to GGUF")
        if arch in _PERMUTED_ROPE and kind in heads:
            data = permute_rows(data, heads[kind])
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(target, np.ascontiguousarray(data, dtype=np.float32))
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(target, data.astype(np.float16))
        elif qtype == GGMLQuantizationType.BF16:
            writer.add_tensor(target, gguf_quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(target, np.ascontiguousarray(data), raw_dtype=qtype)
    if not config.tie_word_embeddings and not has_output:
        raise GGUFError("the checkpoint has no lm_head.weight but its embeddings are not tied")
