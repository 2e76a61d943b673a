"""What ``tollway serve`` reads from a checkpoint: a GGUF file's context window."""

from __future__ import annotations

import inspect
import re
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


@pytest.mark.parametrize(
    ("spawn", "message"),
    [
        ("quantization: int3", "spawn.quantization must be one of int8, int4, got 'int3'"),
        ("quantization: true", "spawn.quantization must be one of int8, int4, got True"),
        ("kv_cache_dtype: fp8", "spawn.kv_cache_dtype must be one of auto, int8, got 'fp8'"),
        (
            "quantization: int4, quantization_group_size: 48",
            "spawn.quantization_group_size must be one of 32, 64, got 48",
        ),
        (
            "quantization: int8, quantization_group_size: 64",
            "spawn.quantization_group_size applies to quantization: int4 only",
        ),
        ("quantization_group_size: 32", "spawn.quantization_group_size applies to"),
        (
            "quantization: int8, args: [--quantization=int4]",
            "give quantization once, as spawn.quantization or --quantization in args",
        ),
        ("dtype: bfloat16", "spawn takes checkpoint, device, quantization, "),
    ],
)
def test_spawn_quantization_settings_are_checked_at_config_load(
    tmp_path: Path, spawn: str, message: str
) -> None:
    """Refused before anything starts, naming the model and the key (the checkpoint need not
    exist: the settings are checked first)."""
    config = tmp_path / "tollway.yaml"
    config.write_text(f"models:\n  m:\n    spawn: {{checkpoint: absent.gguf, {spawn}}}\n")
    with pytest.raises(ValueError, match=f"^model 'm': {re.escape(message)}"):
        config_plan(config, tmp_path / "data", env={})


@pytest.mark.parametrize(
    ("spawn", "message"),
    [
        (
            "speculative_proposer: eagle",
            "spawn.speculative_proposer must be one of ngram, draft, got 'eagle'",
        ),
        ("num_speculative_tokens: 4", "spawn.num_speculative_tokens needs spawn.speculative_pro"),
        ("speculative_draft_model: d.gguf", "spawn.speculative_draft_model needs spawn.specula"),
        (
            "speculative_proposer: draft",
            "spawn.speculative_draft_model (a checkpoint) is needed by, and only by, "
            "speculative_proposer: draft",
        ),
        (
            "speculative_proposer: ngram, speculative_draft_model: d.gguf",
            "spawn.speculative_draft_model (a checkpoint) is needed by",
        ),
        (
            "speculative_proposer: draft, speculative_draft_model: d.gguf, "
            "speculative_ngram_max: 3",
            "spawn.speculative_ngram_max applies to speculative_proposer: ngram",
        ),
        (
            "speculative_proposer: ngram, num_speculative_tokens: 0",
            "spawn.num_speculative_tokens must be a whole number of at least 1, got 0",
        ),
        (
            "speculative_proposer: ngram, num_speculative_tokens: true",
            "spawn.num_speculative_tokens must be a whole number of at least 1, got True",
        ),
        (
            "speculative_proposer: ngram, speculative_crossover_batch_size: '8'",
            "spawn.speculative_crossover_batch_size must be a whole number of at least 1, got '8'",
        ),
        (
            "speculative_proposer: ngram, speculative_ngram_min: 3, speculative_ngram_max: 2",
            "spawn.speculative_ngram_min (3) must be at most speculative_ngram_max (2)",
        ),
        (  # against the engine's default maximum, 4
            "speculative_proposer: ngram, speculative_ngram_min: 5",
            "spawn.speculative_ngram_min (5) must be at most speculative_ngram_max (4)",
        ),
        (
            "speculative_proposer: draft, speculative_draft_model: [d.gguf]",
            "spawn.speculative_draft_model must be a checkpoint's path, got ['d.gguf']",
        ),
        (
            "speculative_proposer: ngram, num_speculative_tokens: 2, "
            "args: [--num-speculative-tokens=3]",
            "give num_speculative_tokens once, as spawn.num_speculative_tokens or "
            "--num-speculative-tokens in args",
        ),
    ],
)
def test_spawn_speculative_settings_are_checked_at_config_load(
    tmp_path: Path, spawn: str, message: str
) -> None:
    """Refused before anything starts, naming the model and the key."""
    config = tmp_path / "tollway.yaml"
    config.write_text(f"models:\n  m:\n    spawn: {{checkpoint: absent.gguf, {spawn}}}\n")
    with pytest.raises(ValueError, match=f"^model 'm': {re.escape(message)}"):
        config_plan(config, tmp_path / "data", env={})


def test_a_draft_model_the_engine_cannot_load_is_refused_at_config_load(tmp_path: Path) -> None:
    """Checked like the spawned checkpoint, relative to the config file."""
    write_tokenizer_gguf(tmp_path / "m.gguf", "gpt-2")
    config = tmp_path / "tollway.yaml"
    config.write_text(
        "models:\n  m:\n    spawn: {checkpoint: m.gguf, speculative_proposer: draft,\n"
        "            speculative_draft_model: drafts/absent.gguf}\n"
    )
    with pytest.raises(ValueError, match=r"^model 'm': spawn\.speculative_draft_model: ") as info:
        config_plan(config, tmp_path / "data", env={})
    assert str(tmp_path / "drafts" / "absent.gguf") in str(info.value)


def test_spawn_without_quantization_settings_leaves_the_engines_defaults(tmp_path: Path) -> None:
    write_tokenizer_gguf(tmp_path / "m.gguf", "gpt-2")
    config = tmp_path / "tollway.yaml"
    config.write_text("models:\n  m:\n    spawn: {checkpoint: m.gguf, kv_cache_dtype: auto}\n")
    (spec,) = config_plan(config, tmp_path / "data", env={}).engines
    assert (spec.quantization, spec.quantization_group_size, spec.kv_cache_dtype) == (
        None,
        None,
        "auto",
    )
    assert "--quantization" not in spec.command()
    assert spec.command()[-2:] == ["--kv-cache-dtype", "auto"]
