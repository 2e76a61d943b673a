"""The engine's command line: one flag per `EngineConfig` field, with the field's own default,
and every flag's value reaches the `EngineConfig` the server is started with."""

from __future__ import annotations

import dataclasses
from typing import Any

import click
import pytest
import typer
from typer.testing import CliRunner

from backend_engine import cli
from backend_engine.config import HELP, EngineConfig
from tests.support.without_engine import run_without_engine

runner = CliRunner()

# One non-default value per field: a new EngineConfig field fails this test until it is here.
NON_DEFAULT_FLAGS: dict[str, tuple[list[str], Any]] = {
    "model": (["--model", "/models/m.gguf"], "/models/m.gguf"),
    "device": (["--device", "cuda:1"], "cuda:1"),
    "dtype": (["--dtype", "bfloat16"], "bfloat16"),
    "quantization": (["--quantization", "int4"], "int4"),
    "quantization_group_size": (["--quantization-group-size", "64"], 64),
    "quantization_calibration": (["--quantization-calibration", "rtn"], "rtn"),
    "dequantize": (["--no-dequantize"], False),
    "kv_cache_dtype": (["--kv-cache-dtype", "int8"], "int8"),
    "speculative_proposer": (["--speculative-proposer", "draft"], "draft"),
    "speculative_draft_model": (["--speculative-draft-model", "/models/d.gguf"], "/models/d.gguf"),
    "num_speculative_tokens": (["--num-speculative-tokens", "6"], 6),
    "speculative_ngram_min": (["--speculative-ngram-min", "3"], 3),
    "speculative_ngram_max": (["--speculative-ngram-max", "5"], 5),
    "speculative_crossover_batch_size": (["--speculative-crossover-batch-size", "2"], 2),
    "speculative_draft_cost": (["--speculative-draft-cost", "0.5"], 0.5),
    "decode_run_steps": (["--decode-run-steps", "4"], 4),
    "decode_run_max_ms": (["--decode-run-max-ms", "20"], 20.0),
    "block_size": (["--block-size", "32"], 32),
    "kv_cache_memory_bytes": (["--kv-cache-memory-bytes", "1048576"], 1 << 20),
    "num_kv_blocks": (["--num-kv-blocks", "100"], 100),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], False),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "512"], 512),
    "max_num_seqs": (["--max-num-seqs", "8"], 8),
    "max_running_share": (["--max-running-share", "0.5"], 0.5),
    "max_model_len": (["--max-model-len", "1024"], 1024),
    "scheduling": (["--scheduling", "static"], "static"),
    "watermark": (["--watermark", "0.2"], 0.2),
    "seed": (["--seed", "7"], 7),
    "num_threads": (["--num-threads", "3"], 3),
    "show_progress": (["--no-show-progress"], False),
    "grammar_cache_size": (["--grammar-cache-size", "16"], 16),
    "grammar_compile_timeout_s": (["--grammar-compile-timeout-s", "1.5"], 1.5),
    "drain_grace_s": (["--drain-grace-s", "2.5"], 2.5),
}


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[tuple[EngineConfig, dict[str, Any]]]:
    """What `cli.run_server` is called with (in place of loading the model and serving it)."""
    calls: list[tuple[EngineConfig, dict[str, Any]]] = []
    monkeypatch.setattr(cli, "run_server", lambda config, **where: calls.append((config, where)))
    return calls


def _engine_command() -> click.Command:
    return typer.main.get_command(cli.engine_app)


def test_every_engine_setting_is_a_flag_with_the_configs_default() -> None:
    params = {param.name: param for param in _engine_command().params}
    for config_field in dataclasses.fields(EngineConfig):
        assert config_field.name in params, f"no flag for EngineConfig.{config_field.name}"
        param = params[config_field.name]
        assert param.help == config_field.metadata[HELP]
        if config_field.default is dataclasses.MISSING:
            assert param.required
        else:
            assert param.default == config_field.default, config_field.name


def test_the_kv_cache_default_is_the_configs() -> None:
    (param,) = (p for p in _engine_command().params if p.name == "kv_cache_memory_bytes")
    assert param.default == EngineConfig(model="m").kv_cache_memory_bytes == 512 << 20


def test_every_flag_reaches_the_engine_config(started: list[Any]) -> None:
    """In two runs: speculative decoding's flags exclude an int8 KV cache."""
    assert NON_DEFAULT_FLAGS.keys() == {f.name for f in dataclasses.fields(EngineConfig)}
    speculative = {name for name in NON_DEFAULT_FLAGS if "speculative" in name}
    for group in (set(NON_DEFAULT_FLAGS) - speculative, speculative | {"model"}):
        flags = {name: NON_DEFAULT_FLAGS[name] for name in group}
        args = [arg for arg_list, _ in flags.values() for arg in arg_list]
        result = runner.invoke(cli.engine_app, [*args, "--uds", "/tmp/e.sock", "--port", "9"])
        assert result.exit_code == 0, result.output
        config, where = started.pop()
        assert config == EngineConfig(**{name: value for name, (_, value) in flags.items()})
        assert where == {"host": "127.0.0.1", "port": 9, "uds": "/tmp/e.sock", "model_name": None}


def test_only_the_model_is_required(started: list[Any]) -> None:
    result = runner.invoke(cli.engine_app, ["--model", "m", "--served-model-name", "small"])
    assert result.exit_code == 0, result.output
    ((config, where),) = started
    assert config == EngineConfig(model="m")
    assert where["model_name"] == "small"
    assert where["uds"] is None


def test_a_setting_the_config_refuses_is_a_usage_error(started: list[Any]) -> None:
    result = runner.invoke(cli.engine_app, ["--model", "m", "--watermark", "1.5"])
    assert result.exit_code == 2
    assert "watermark must be in [0, 1)" in result.output
    result = runner.invoke(cli.engine_app, ["--model", "m", "--drain-grace-s", "-1"])
    assert result.exit_code == 2
    assert "drain_grace_s must be 0 or more" in result.output
    result = runner.invoke(cli.engine_app, ["--model", "m", "--decode-run-steps", "0"])
    assert result.exit_code == 2
    assert "decode_run_steps must be at least 1" in result.output
    result = runner.invoke(cli.engine_app, ["--model", "m", "--max-running-share", "0"])
    assert result.exit_code == 2
    assert "max_running_share must be in (0, 1]" in result.output
    result = runner.invoke(cli.engine_app, ["--model", "m", "--kv-cache-dtype", "int4"])
    assert result.exit_code == 2
    assert "kv_cache_dtype must be one of ('auto', 'int8')" in result.output
    result = runner.invoke(
        cli.engine_app, ["--model", "m", "--quantization", "int8", "--dequantize"]
    )
    assert result.exit_code == 2
    assert "quantization and dequantize exclude each other" in result.output
    assert started == []


def test_speculative_decoding_by_ngram_is_three_flags(started: list[Any]) -> None:
    flags = ["--speculative-proposer", "ngram", "--num-speculative-tokens", "3"]
    result = runner.invoke(cli.engine_app, ["--model", "m", *flags, "--speculative-ngram-max", "6"])
    assert result.exit_code == 0, result.output
    ((config, _),) = started
    assert config == EngineConfig(
        model="m", speculative_proposer="ngram", num_speculative_tokens=3, speculative_ngram_max=6
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--speculative-proposer", "medusa"],
            "speculative_proposer must be one of ('ngram', 'draft'), got 'medusa'",
        ),
        (
            ["--speculative-proposer", "draft"],
            "speculative_draft_model is needed by, and only by, speculative_proposer='draft'",
        ),
        (["--speculative-draft-model", "d.gguf"], "speculative_draft_model is needed by"),
        (["--num-speculative-tokens", "0"], "num_speculative_tokens must be at least 1, got 0"),
        (
            ["--speculative-ngram-min", "5"],
            "1 <= speculative_ngram_min <= speculative_ngram_max, got 5 and 4",
        ),
        (
            ["--speculative-crossover-batch-size", "0"],
            "speculative_crossover_batch_size must be at least 1, got 0",
        ),
    ],
)
def test_a_speculative_setting_the_config_refuses_is_a_usage_error(
    started: list[Any], flags: list[str], message: str
) -> None:
    """Said in one line by the command (exit code 2), not as a traceback."""
    result = runner.invoke(cli.engine_app, ["--model", "m", *flags])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    said = " ".join(result.output.replace("│", " ").split())  # rich wraps it in a box
    assert message in said
    assert "Traceback" not in result.output
    assert started == []


def test_a_setting_without_help_cannot_become_a_flag() -> None:
    @dataclasses.dataclass(frozen=True)
    class WithNewSetting(EngineConfig):
        new_setting: int = 0

    with pytest.raises(TypeError, match=r"WithNewSetting\.new_setting has no 'help'"):
        cli.engine_config_options(WithNewSetting)


def test_without_torch_the_engine_says_how_to_install_it() -> None:
    result = run_without_engine(
        "from backend_engine.cli import engine_app\nengine_app()\n",
        "--model",
        "m.gguf",
    )
    assert result.returncode == 1
    assert result.stderr.strip() == "error: torch is not installed: pip install 'tollway[engine]'"
