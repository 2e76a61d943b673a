"""Model registry: a checkpoint's ``architectures[0]`` -> the module class that runs it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from backend_engine.model_loader.weight_quantization import quantize_weights
from backend_engine.model_loader.weights import (
    iter_checkpoint_weights,
    iter_checkpoint_weights_as_stored,
    resolve_dtype,
)
from backend_engine.models.calibration import CALIBRATION_METHODS, calibrated_hessians
from backend_engine.models.linear_assembly import Shard
from backend_engine.models.llama import CausalLM, KVCache
from model_files.checkpoint import Checkpoint
from model_files.model_config import ModelConfig

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
}


def model_class(architecture: str) -> type[CausalLM]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; "
            f"supported: {', '.join(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[architecture]


def load_model(
    checkpoint: Checkpoint | str | Path,
    config: ModelConfig,
    dtype: str,
    device: str,
    show_progress: bool = False,
    keep_gguf_blocks: bool = False,
    quantization: str | None = None,
    group_size: int = 32,
    calibration: str = "gptq",
) -> CausalLM:
    """Build the model for ``config`` on ``device`` and fill it from ``checkpoint`` (a
    Hugging Face directory or a GGUF file).

    ``dtype`` is ``"auto"`` (the checkpoint's ``torch_dtype``) or a dtype name. A GGUF file's
    quantized weights are widened to it, unless ``keep_gguf_blocks`` (CPU only: the kernels
    that read ggml blocks are CPU kernels): then its linears and embedding stay in the
    file's blocks (`backend_engine.models.quantized_linear`) and everything else is ``dtype``.
    ``quantization`` (``"int8"`` or ``"int4"`` in groups of ``group_size``) quantizes float
    weights as they load (`backend_engine.model_loader.weight_quantization`); a GGUF file's
    quantized tensors kept as stored pass through as they are. Under int4, ``calibration``
    ``"gptq"`` first loads the model in float32 and runs it on calibration text
    (`backend_engine.models.calibration`) for GPTQ; ``"rtn"`` rounds to the nearest.
    """
    if calibration not in CALIBRATION_METHODS:
        raise ValueError(f"calibration must be one of {CALIBRATION_METHODS}, got {calibration!r}")
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = Checkpoint(checkpoint)
    torch_dtype = resolve_dtype(dtype, config)
    keep_blocks = keep_gguf_blocks and checkpoint.is_gguf
    if keep_blocks and torch.device(device).type != "cpu":
        raise ValueError("GGUF blocks are kept on the CPU only; dequantize for CUDA")
    model = model_class(config.architecture)(
        config,
        torch_dtype,
        torch.device(device),
        lazy_linears=keep_blocks or quantization is not None,
    )
    weights: Iterable[tuple[str, Shard]] = (
        iter_checkpoint_weights_as_stored(checkpoint, torch_dtype, show_progress)
        if keep_blocks
        else iter_checkpoint_weights(checkpoint, torch_dtype, show_progress)
    )
    if quantization is not None:
        device_type = torch.device(device).type
        hessians = (
            gptq_hessians(checkpoint, config, device, show_progress)
            if quantization == "int4" and calibration == "gptq"
            else None
        )
        weights = quantize_weights(
            weights, quantization, group_size, device_type, show_progress, hessians
        )
    model.load_weights(weights)
    return model.eval()


def gptq_hessians(
    checkpoint: Checkpoint, config: ModelConfig, device: str, show_progress: bool = False
) -> dict[str, torch.Tensor]:
    """GPTQ's input Hessians of every decoder linear, from ``checkpoint`` loaded in float32
    (then released) and run on the calibration text."""
    float_model = load_model(checkpoint, config, "float32", device, show_progress)
    return calibrated_hessians(float_model, checkpoint.tokenizer(), show_progress)


__all__ = ["MODEL_REGISTRY", "CausalLM", "KVCache", "gptq_hessians", "load_model", "model_class"]
