import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from typer.testing import CliRunner, Result

from gateway.launcher.cli import app
from tests.support.gguf_files import FFN, HIDDEN, hf_tensors, write_gguf
from tests.support.without_engine import needs_engine

runner = CliRunner()


@needs_engine
def test_demo_model_writes_a_loadable_checkpoint(tmp_path):
    result = runner.invoke(app, ["demo-model", str(tmp_path / "m"), "--size", "tiny"])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "m" / name).is_file()


@needs_engine
def test_demo_model_rejects_an_unknown_size(tmp_path):
    result = runner.invoke(app, ["demo-model", str(tmp_path / "m"), "--size", "huge"])
    assert result.exit_code != 0
    assert "size must be one of" in result.output


@needs_engine
def test_engine_rejects_bad_settings_before_loading(tmp_path):
    result = runner.invoke(app, ["engine", "--model", str(tmp_path), "--block-size", "3"])
    assert result.exit_code != 0
    assert "power of two" in result.output


@needs_engine
def test_engine_reports_a_missing_checkpoint_clearly(tmp_path):
    result = runner.invoke(app, ["engine", "--model", str(tmp_path / "nowhere")])
    assert result.exit_code != 0
    assert result.exit_code == 1
    assert "error:" in result.output
    assert "config.json" in result.output


# -- GGUF files the engine cannot serve: one line naming what is wrong, exit 1 -------------


def _bad_gguf_files(directory: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the error must say)."""
    good = write_gguf(directory / "good.gguf", hf_tensors(), tokenizer_pre="smollm")
    data = good.read_bytes()
    truncated = directory / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 3])
    block_size, type_size = gguf.GGML_QUANT_SIZES[Q.Q2_K]
    q2k = hf_tensors()
    del q2k["model.layers.0.mlp.gate_proj.weight"]
    blocks = np.zeros((FFN, HIDDEN * 4 // block_size * type_size), dtype=np.uint8)
    return {
        "truncated": (truncated, r"truncated\.gguf is not a readable GGUF file"),
        "architecture": (
            write_gguf(directory / "gpt2.gguf", hf_tensors(), arch="gpt2", tokenizer_pre="gpt-2"),
            "unsupported GGUF architecture 'gpt2'",
        ),
        "tensor_type": (
            write_gguf(
                directory / "q2k.gguf",
                q2k,
                tokenizer_pre="smollm",
                raw={"blk.0.ffn_gate.weight": (blocks, Q.Q2_K)},
            ),
            r"blk\.0\.ffn_gate\.weight has type Q2_K",
        ),
        "pre_tokenizer": (
            write_gguf(directory / "pre.gguf", hf_tensors(), tokenizer_pre="no-such-regex"),
            "unknown GGUF pre-tokenizer 'no-such-regex'",
        ),
    }


BAD_FILES = ["truncated", "architecture", "tensor_type", "pre_tokenizer"]


def _assert_one_line_error(result: Result, pattern: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: "), result.output
    assert re.search(pattern, lines[0]), lines[0]


@needs_engine
@pytest.mark.parametrize("kind", BAD_FILES)
def test_engine_refuses_a_bad_gguf_file_in_one_line(tmp_path: Path, kind: str) -> None:
    path, message = _bad_gguf_files(tmp_path)[kind]
    result = runner.invoke(app, ["engine", "--model", str(path)])
    _assert_one_line_error(result, message)


@pytest.mark.parametrize("kind", BAD_FILES)
def test_serve_refuses_a_bad_gguf_file_in_one_line_before_starting(
    tmp_path: Path, kind: str
) -> None:
    path, message = _bad_gguf_files(tmp_path)[kind]
    config = tmp_path / "tollway.yaml"
    config.write_text(f"models:\n  m:\n    spawn: {{checkpoint: {path}}}\n")
    data = tmp_path / "data"
    result = runner.invoke(app, ["serve", "--config", str(config), "--data-dir", str(data)])
    _assert_one_line_error(result, f"model 'm': spawn checkpoint: .*{message}")
    assert not data.exists()  # refused before anything was created
