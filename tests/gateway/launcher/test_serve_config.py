"""What ``tollway serve`` reads from a checkpoint: a GGUF file's context window."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from gateway.defaults import DEFAULT_DATA_DIR, DEFAULT_HOST, DEFAULT_PORT
from gateway.launcher import serve_cli
from gateway.launcher.serve_config import config_plan, context_window
from tests.model_files.gguf_tokenizer_files import write_tokenizer_gguf


def test_a_gguf_files_context_window_comes_from_its_metadata(tmp_path: Path) -> None:
    path = write_tokenizer_gguf(tmp_path / "m.gguf", "gpt-2")  # llama.context_length = 256
    assert context_window(path) == 256


def test_a_missing_gguf_file_is_named(tmp_path: Path) -> None:
    """An error ``tollway serve`` prints as one line (it catches ValueError and OSError)."""
    with pytest.raises((ValueError, OSError), match="no GGUF file at"):
        context_window(tmp_path / "absent.gguf")


def test_a_config_without_an_address_listens_where_the_embedded_default_does(
    tmp_path: Path,
) -> None:
    """One default port: `tollway serve --config` with no port listens where `make serve`
    does (the settings file used to say 8080 and the launcher 8000)."""
    config = tmp_path / "tollway.yaml"
    config.write_text(
        "models:\n  remote:\n    upstreams: [http://10.0.0.2:8100]\n    context_window: 4096\n",
        encoding="utf-8",
    )
    settings = config_plan(config, data_dir=None, env={}).settings
    assert (settings.host, settings.port) == (DEFAULT_HOST, DEFAULT_PORT) == ("127.0.0.1", 8000)
    assert settings.data_dir == (tmp_path / DEFAULT_DATA_DIR).resolve()


def test_the_serve_flags_name_the_default_address() -> None:
    """`tollway serve --help` states the defaults the settings hold, not copies of them."""
    # not get_type_hints: before Python 3.11 it wraps a None default's hint in Optional
    parameters = inspect.signature(serve_cli.serve, eval_str=True).parameters
    helps = {name: parameters[name].annotation.__metadata__[0].help for name in ("host", "port")}
    assert f"default {DEFAULT_HOST}" in helps["host"]
    assert f"default {DEFAULT_PORT}" in helps["port"]
