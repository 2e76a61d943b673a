"""Random-weight demo checkpoints in exact Hugging Face format, written offline.

A checkpoint directory holds what ``transformers`` itself would load::

    config.json, generation_config.json, tokenizer.json, tokenizer_config.json
                                     (``demo_model_files``: everything but the weights)
    model.safetensors                (or model-0000i-of-0000N.safetensors
                                     + model.safetensors.index.json when sharded)

Everything is deterministic: the same ``size``/``seed``/options give byte-identical files.
The tokenizer depends only on ``size``; the weights on ``size``, ``seed`` and the options.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress
from safetensors.torch import save_file

from backend_engine.demo.checkpoint_files import (
    DEMO_SHAPES,
    DemoShape,
    check_demo_options,
    write_demo_model_files,
    write_json,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _init_weights(
    shape: DemoShape, architecture: str, tie_word_embeddings: bool, seed: int
) -> dict[str, torch.Tensor]:
    """Random weights, scaled so that every layer matters and logits are well spread.

    Linear layers get std 1/sqrt(fan_in) (outputs of order one, so attention shapes the result),
    the embedding std 1 and the lm_head std 2/sqrt(hidden): the final RMSNorm makes logits
    roughly N(0, 2^2), so top-1/top-2 gaps are rarely below float noise.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden, head_dim = shape.hidden_size, shape.head_dim
    q_dim = shape.num_attention_heads * head_dim
    kv_dim = shape.num_key_value_heads * head_dim

    def normal(*size: int, std: float) -> torch.Tensor:
        return torch.randn(*size, generator=gen) * std

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        # [out_features, in_features], the nn.Linear layout
        return normal(out_features, in_features, std=1.0 / math.sqrt(in_features))

    embed_std = 2.0 / math.sqrt(hidden) if tie_word_embeddings else 1.0
    weights = {"model.embed_tokens.weight": normal(shape.vocab_size, hidden, std=embed_std)}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.ones(hidden)
        weights[p + "self_attn.q_proj.weight"] = linear(q_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_dim, hidden)
        if architecture == "Qwen2ForCausalLM":
            weights[p + "self_attn.q_proj.bias"] = normal(q_dim, std=0.1)
            weights[p + "self_attn.k_proj.bias"] = normal(kv_dim, std=0.1)
            weights[p + "self_attn.v_proj.bias"] = normal(kv_dim, std=0.1)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, q_dim)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        weights[p + "mlp.gate_proj.weight"] = linear(shape.intermediate_size, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(shape.intermediate_size, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, shape.intermediate_size)
    weights["model.norm.weight"] = torch.ones(hidden)
    if not tie_word_embeddings:
        weights["lm_head.weight"] = normal(shape.vocab_size, hidden, std=2.0 / math.sqrt(hidden))
    return weights


def _write_weights(path: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    names = list(weights)
    if not 1 <= num_shards <= len(names):
        raise ValueError(f"num_shards must be between 1 and {len(names)}, got {num_shards}")
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(weights, str(path / "model.safetensors"), metadata=metadata)
        return
    sizes = [weights[n].numel() * weights[n].element_size() for n in names]
    total_size = sum(sizes)
    # Contiguous groups of about total_size / num_shards bytes each, none empty.
    groups: list[list[str]] = []
    start, written = 0, 0
    for k in range(num_shards):
        end_limit = len(names) - (num_shards - k - 1)
        target = total_size * (k + 1) / num_shards
        end = start + 1
        written += sizes[start]
        while end < end_limit and written < target:
            written += sizes[end]
            end += 1
        groups.append(names[start:end])
        start = end
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups):
        filename = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: weights[n] for n in group}, str(path / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(group, filename))
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(path / "model.safetensors.index.json", index)


def write_demo_checkpoint(
    path: str | Path,
    *,
    size: str = "small",
    seed: int = 0,
    architecture: str = "LlamaForCausalLM",
    dtype: str = "float32",
    tie_word_embeddings: bool | None = None,
    rope_scaling: dict[str, Any] | None = None,
    num_shards: int = 1,
    show_progress: bool = False,
) -> Path:
    """Write a random-weight checkpoint for ``architecture`` into ``path`` and return it."""
    check_demo_options(size, architecture, dtype, rope_scaling)
    shape = DEMO_SHAPES[size]
    tied = bool(tie_word_embeddings)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    with Progress(disable=not show_progress, transient=True) as progress:
        task = progress.add_task(f"demo checkpoint ({size}, {architecture})", total=3)
        progress.update(task, description="tokenizer and configs")
        write_demo_model_files(
            out,
            size=size,
            architecture=architecture,
            dtype=dtype,
            tie_word_embeddings=tied,
            rope_scaling=rope_scaling,
        )
        progress.advance(task)

        progress.update(task, description="initializing weights")
        weights = _init_weights(shape, architecture, tied, seed)
        weights = {name: t.to(_DTYPES[dtype]).contiguous() for name, t in weights.items()}
        progress.advance(task)

        progress.update(task, description="writing safetensors")
        _write_weights(out, weights, num_shards)
        progress.advance(task)
    return out
