"""Read a checkpoint's weights as ``(name, tensor)`` pairs: `iter_checkpoint_weights` for
either kind, `iter_weights` for a Hugging Face safetensors directory.

A checkpoint is either one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Tensors are memory-mapped and converted to the target
dtype one at a time, so peak memory stays near one copy of the model.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from safetensors import safe_open

from kernels.cpu_quant_linear import GGUFBlockWeight
from model_files.checkpoint import Checkpoint
from model_files.model_config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, config: ModelConfig) -> torch.dtype:
    """``"auto"`` means the checkpoint's ``torch_dtype``; otherwise a dtype name."""
    name = config.torch_dtype if dtype == "auto" else dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {tuple(_DTYPES)}, got {dtype!r}")
    return _DTYPES[name]


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, checked to exist."""
    root = Path(path)
    index_path = root / INDEX_FILE
    if index_path.is_file():
        with index_path.open() as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index_path} lists weight files that do not exist: {', '.join(missing)}"
            )
        return files
    single = root / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no weights found in {root}: expected {SINGLE_FILE} or {INDEX_FILE} "
        "(only safetensors checkpoints are supported)"
    )


def iter_weights(
    path: str | Path, dtype: torch.dtype, show_progress: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of the checkpoint, converted to ``dtype``, shard by shard."""
    files = weight_files(path)
    if not show_progress:
        for file in files:
            yield from _iter_file(file, dtype)
        return
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            total += len(list(f.keys()))
    columns = (
        TextColumn("[bold]Loading weights"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tensors, {task.fields[shard]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task("weights", total=total, shard="")
        for i, file in enumerate(files, start=1):
            progress.update(task, shard=f"shard {i}/{len(files)}")
            for item in _iter_file(file, dtype):
                yield item
                progress.advance(task)


def _iter_file(file: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            yield name, f.get_tensor(name).to(dtype)


def check_weight_names(missing: Collection[str], unexpected: Collection[str]) -> None:
    """Raise a ``ValueError`` listing names the model needed but did not get, and vice versa."""
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(sorted(missing))}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(sorted(unexpected))}")
    if problems:
        raise ValueError("checkpoint does not match the model config; " + "; ".join(problems))


def iter_checkpoint_weights(
    checkpoint: Checkpoint, dtype: torch.dtype, show_progress: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor under its Hugging Face name, in ``dtype`` (a GGUF file's dequantized)."""
    if checkpoint.is_gguf:
        from backend_engine.model_loader.gguf_weights import iter_gguf_weights

        return iter_gguf_weights(checkpoint.reader, dtype, show_progress)
    return iter_weights(checkpoint.path, dtype, show_progress)


def iter_checkpoint_weights_as_stored(
    checkpoint: Checkpoint, dtype: torch.dtype, show_progress: bool = False
) -> Iterator[tuple[str, torch.Tensor | GGUFBlockWeight]]:
    """As `iter_checkpoint_weights`, but a GGUF file's quantized tensors stay in their blocks
    (the types :mod:`kernels.cpu_quant_linear` reads; others are dequantized)."""
    if checkpoint.is_gguf:
        from backend_engine.model_loader.gguf_weights import iter_gguf_weights_as_stored

        return iter_gguf_weights_as_stored(checkpoint.reader, dtype, show_progress)
    return iter_weights(checkpoint.path, dtype, show_progress)
