"""What ``tollway serve`` reads from a checkpoint: a GGUF file's context window."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.launcher.serve_config import context_window
from tests.backend_engine.gguf_tokenizer_files import write_tokenizer_gguf


def test_a_gguf_files_context_window_comes_from_its_metadata(tmp_path: Path) -> None:
    path = write_tokenizer_gguf(tmp_path / "m.gguf", "gpt-2")  # llama.context_length = 256
    assert context_window(path) == 256


def test_a_missing_gguf_file_is_named(tmp_path: Path) -> None:
    """An error ``tollway serve`` prints as one line (it catches ValueError and OSError)."""
    with pytest.raises((ValueError, OSError), match="no GGUF file at"):
        context_window(tmp_path / "absent.gguf")
