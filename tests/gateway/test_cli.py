import json

from typer.testing import CliRunner

from gateway.cli import app

runner = CliRunner()


def test_demo_model_writes_a_loadable_checkpoint(tmp_path):
    result = runner.invoke(app, ["demo-model", str(tmp_path / "m"), "--size", "tiny"])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "m" / name).is_file()


def test_demo_model_rejects_an_unknown_size(tmp_path):
    result = runner.invoke(app, ["demo-model", str(tmp_path / "m"), "--size", "huge"])
    assert result.exit_code != 0
    assert "size must be one of" in result.output


def test_engine_rejects_bad_settings_before_loading(tmp_path):
    result = runner.invoke(app, ["engine", "--model", str(tmp_path), "--block-size", "3"])
    assert result.exit_code != 0
    assert "power of two" in result.output


def test_engine_reports_a_missing_checkpoint_clearly(tmp_path):
    result = runner.invoke(app, ["engine", "--model", str(tmp_path / "nowhere")])
    assert result.exit_code != 0
    assert result.exit_code == 1
    assert "error:" in result.output and "config.json" in result.output
