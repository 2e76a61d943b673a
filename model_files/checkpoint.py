"""A checkpoint the engine can serve, resolved once: a Hugging Face directory or a GGUF file.

Everything that opens a checkpoint goes through `Checkpoint`: the engine (config,
tokenizer, prefix-cache identity; its weights through `backend_engine.model_loader`),
``tollway engine --model`` and the plans of
``tollway serve`` (context window, early checks). The two kinds::

    DIR/            config.json, model.safetensors (or shards + index), tokenizer files
    FILE.gguf       llama.cpp's format: metadata (config, tokenizer, chat template) + tensors

A GGUF file's reader parses the whole vocabulary when it opens (a second for 49k tokens), so
it is opened once per `Checkpoint` and shared by the config, the tokenizer and the weights.

Nothing here imports torch: the gateway reads context windows and checks spawned checkpoints
through it, and the planner reads a model's shape.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from model_files.gguf_metadata import (
    GGUFError,
    check_tensor_types,
    hf_config,
    is_gguf,
    open_gguf,
)
from model_files.gguf_tokenizer import tokenizer_from_gguf
from model_files.model_config import ModelConfig
from model_files.tokenizer import Tokenizer

if TYPE_CHECKING:
    from gguf import GGUFReader

CONFIG_FILE = "config.json"


class Checkpoint:
    """One checkpoint on disk, checked to exist when made; its parts are read when asked for."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.is_gguf = is_gguf(self.path)
        if self.is_gguf:
            if not self.path.is_file():
                raise FileNotFoundError(f"no GGUF file at {self.path}")
        elif not (self.path / CONFIG_FILE).is_file():
            raise FileNotFoundError(
                f"no config.json found at {self.path / CONFIG_FILE}: a checkpoint is a "
                "Hugging Face directory or a .gguf file"
            )

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r})"

    @cached_property
    def reader(self) -> GGUFReader:
        """The GGUF file's reader (GGUF checkpoints only)."""
        if not self.is_gguf:
            raise ValueError(f"{self.path} is not a GGUF file")
        return open_gguf(self.path)

    def model_config(self) -> ModelConfig:
        if self.is_gguf:
            return ModelConfig.from_dict(hf_config(self.reader))
        return ModelConfig.from_pretrained(self.path)

    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer (built once: `check` builds it too)."""
        return self._tokenizer

    @cached_property
    def _tokenizer(self) -> Tokenizer:
        if self.is_gguf:
            return tokenizer_from_gguf(self.reader, source=str(self.path))
        return Tokenizer.from_pretrained(self.path)

    def check(self) -> ModelConfig:
        """The config, after checking what can be checked without torch or the weights: the
        config, the tokenizer and, for a GGUF file, every tensor's type. Raises `GGUFError` (a
        `ValueError`), another `ValueError` or `FileNotFoundError`, naming what is wrong.

        ``tollway serve`` calls it on every checkpoint before it starts anything, and the
        engine before it builds anything, so a bad file is refused in one line, by name.
        """
        config = self.model_config()
        self.tokenizer()
        if self.is_gguf:
            check_tensor_types(self.reader)
        return config

    def fingerprint(self) -> str:
        """Which files, as they are now: the resolved path, and each weight file's name, size
        and modification time. Two checkpoints with the same fingerprint hold the same model."""
        path = self.path.resolve()
        files = [path] if self.is_gguf else sorted(path.glob("*.safetensors"))
        stamps = "".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns};" for p in files)
        return f"{path}|{stamps}"


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A checkpoint's tokenizer alone: a Hugging Face directory's tokenizer files (no
    ``config.json`` needed) or a ``.gguf`` file's vocabulary, rebuilt."""
    if is_gguf(Path(path)):
        return tokenizer_from_gguf(open_gguf(path), source=str(path))
    return Tokenizer.from_pretrained(path)


__all__ = ["CONFIG_FILE", "Checkpoint", "GGUFError", "load_tokenizer"]
