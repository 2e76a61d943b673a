"""``tollway plan``: options to plan, the table and the JSON, and one line for bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from typer.testing import CliRunner

from capacity_planner.model_shape import shape_from_checkpoint
from gateway.launcher.cli import app
from tests.support.gguf_files import hf_tensors, write_gguf

runner = CliRunner()

MILLION_USERS = ["--daily-users", "1000000", "--peak-active-fraction", "0.05"]
MILLION_USERS += ["--in-flight-fraction", "0.3333333333333333"]
CHAT = ["--prompt-tokens", "2500", "--output-tokens", "500", "--stream-tokens-per-s", "30"]
LLAMA_8B = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--params", "8e9"]
H100 = ["--gpu", "h100-80gb"]
JSON_KEYS = {
    "kv_bytes_per_token", "weights_bytes", "peak_streams", "peak_output_tokens_per_s",
    "gpu_output_tokens_per_s", "streams_per_gpu", "tensor_parallel", "gpus_at_peak",
    "gpus_with_headroom", "kv_bytes_per_gpu", "fits", "cost_per_million_output_tokens",
}  # fmt: skip


def plan(*args: str) -> dict[str, object]:
    result = runner.invoke(app, ["plan", *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_the_million_user_example_as_json() -> None:
    data = plan(
        *MILLION_USERS, *CHAT, *LLAMA_8B, *H100, "--gpu-tokens-per-second", "2500",
        "--usable-memory-fraction", "1", "--headroom-fraction", "0.4",
        "--dollars-per-gpu-hour", "3",
    )  # fmt: skip
    assert data.keys() >= JSON_KEYS
    assert (data["gpus_at_peak"], data["gpus_with_headroom"]) == (200, 280)
    assert data["kv_bytes_per_token"] == 131_072
    assert data["weights_bytes"] == 16e9
    assert data["fits"] is True
    assert data["tensor_parallel"] == 1
    assert data["gpu_throughput_source"] == "given"
    assert data["cost_per_month"] == 280 * 3 * 730
    assert data["gpu"]["name"] == "h100-80gb"
    assert "datasheet" in data["gpu"]["source"]
    steps = data["steps"]
    assert isinstance(steps, list)
    assert {s["key"] for s in steps} >= JSON_KEYS


def test_the_table_shows_each_step_with_its_formula() -> None:
    wide = {"COLUMNS": "300"}  # one line per formula
    result = runner.invoke(app, ["plan", *MILLION_USERS, *CHAT, *LLAMA_8B, *H100], env=wide)
    assert result.exit_code == 0, result.output
    for label in ("KV cache per token", "Peak concurrent streams", "Per-GPU output tokens/s"):
        assert label in result.output
    assert "2 × 32 layers × 8 KV heads × 128 head dim" in result.output
    assert "roofline on 1 GPU(s)" in result.output  # no rate given: the roofline's


def test_the_roofline_sizes_a_70b_model_on_a_group_of_h100s() -> None:
    llama_70b = ["--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--params", "70e9"]
    data = plan(*MILLION_USERS, *CHAT, *llama_70b, *H100)
    # The weights fit on 2, but leave room for 4 streams; 4 GPUs give 20x the rate per GPU.
    assert data["tensor_parallel"] == 4
    assert data["fits"] is True  # the roofline stops the batch where the KV cache is full
    assert isinstance(data["gpus_at_peak"], int)
    assert data["gpus_at_peak"] % 4 == 0
    forced = plan(*MILLION_USERS, *CHAT, *llama_70b, *H100, "--tensor-parallel", "2")
    assert forced["tensor_parallel"] == 2
    assert forced["gpus_at_peak"] > 10 * data["gpus_at_peak"]  # type: ignore[operator]


def test_a_gguf_checkpoint_and_a_custom_gpu(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "m.gguf", hf_tensors())
    data = plan(
        "--requests-per-day", "1e6", "--peak-factor", "3", "--prompt-tokens", "3000",
        "--output-tokens", "500", "--model", str(gguf), "--gpu-memory-gb", "24",
        "--gpu-bandwidth-gb-s", "300", "--gpu-tflops", "121", "--kv-cache-dtype", "fp8",
    )  # fmt: skip
    assert data["model"]["num_layers"] == 2  # type: ignore[index]
    assert data["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 1  # fp8: one byte an element
    assert data["gpu"]["name"] == "custom"  # type: ignore[index]


def test_a_gguf_file_is_planned_as_it_stores_its_weights(tmp_path: Path) -> None:
    """Its quantization detected (Q8_0: 8.5 bits a weight), unless --weight-quantization says
    how it will be served."""
    gguf = write_gguf(tmp_path / "m.gguf", hf_tensors(), qtype=Q.Q8_0)
    args = (
        "--requests-per-day", "1e6", "--peak-factor", "3", "--prompt-tokens", "3000",
        "--output-tokens", "500", "--model", str(gguf), "--gpu", "l4",
    )  # fmt: skip
    stored = plan(*args)
    shape = shape_from_checkpoint(gguf)
    assert shape.stored is not None
    assert stored["weights_bytes"] == shape.stored.num_bytes
    assert stored["weights_bytes"] < shape.num_params * 1.1  # about a byte a weight, not bf16's 2
    as_int4 = plan(*args, "--weight-quantization", "int4")
    assert as_int4["weights_bytes"] == math.ceil(shape.num_params * 0.625)  # with scales, mins


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--daily-users", "0", *MILLION_USERS[2:], *CHAT, *LLAMA_8B, *H100], 1,
         "error: --daily-users must be greater than 0, got 0.0"),
        ([*MILLION_USERS, *CHAT, "--output-tokens", "-5", *LLAMA_8B, *H100], 1,
         "error: --output-tokens must be greater than 0, got -5.0"),
        ([*MILLION_USERS, *CHAT, *LLAMA_8B, *H100, "--headroom-fraction", "-1"], 1,
         "error: --headroom-fraction must be 0 or more, got -1.0"),
        ([*MILLION_USERS, *CHAT, *LLAMA_8B[:-1], "0", *H100], 1,
         "error: --params must be greater than 0, got 0"),
        (["--daily-users", "inf", *MILLION_USERS[2:], *CHAT, *LLAMA_8B, *H100], 1,
         "error: --daily-users must be a finite number, got inf"),
        ([*MILLION_USERS, *CHAT, *LLAMA_8B[:-1], "1e400", *H100], 1,
         "error: --params must be a finite number, got inf"),
        ([*MILLION_USERS, *CHAT, *LLAMA_8B, "--gpu-memory-gb", "nan", "--gpu-bandwidth-gb-s",
          "1", "--gpu-tflops", "1"], 1,
         "error: --gpu-memory-gb must be a finite number above 0, got nan"),
        ([*MILLION_USERS, *CHAT, *LLAMA_8B, "--gpu", "b200"], 1,
         "error: unknown GPU preset 'b200'; presets: h100-80gb, h200-141gb, a100-80gb, l40s, l4"),
        ([*MILLION_USERS, *CHAT, *LLAMA_8B, *H100, "--dtype", "fp6"], 1,
         "error: unknown number format 'fp6'; formats: float32, bfloat16, float16, fp8, int8, "
         "int4"),
        ([*MILLION_USERS, *CHAT, "--layers", "126", "--kv-heads", "8", "--head-dim", "128",
          "--params", "405e9", "--gpu", "l4"], 1,
         "error: the model does not fit on any tensor-parallel group of up to 8 l4: it needs "
         "811.55 GB (755.81 GiB) (weights and one stream's KV cache), 8 GPUs hold "
         "172.80 GB (160.93 GiB) usable"),
        ([*MILLION_USERS, *CHAT, "--layers", "80", "--kv-heads", "8", "--head-dim", "128",
          "--params", "70e9", *H100, "--tensor-parallel", "1"], 1,
         "error: --tensor-parallel 1 is too small: the weights and one stream's KV cache need "
         "2 h100-80gb"),
        ([*MILLION_USERS, "--requests-per-day", "5", *CHAT, *LLAMA_8B, *H100], 2,
         "error: give one kind of traffic: --daily-users, --peak-active-fraction and "
         "--in-flight-fraction; or --requests-per-day and --peak-factor; or --from-usage"),
        (["--requests-per-day", "5", *CHAT, *LLAMA_8B, *H100], 2, "error: missing --peak-factor"),
        ([*MILLION_USERS, *CHAT, *H100], 2,
         "error: give --model PATH, or --layers, --kv-heads, --head-dim and --params"),
        ([*MILLION_USERS, *CHAT, *LLAMA_8B], 2,
         "error: give --gpu (h100-80gb, h200-141gb, a100-80gb, l40s, l4), or --gpu-memory-gb, "
         "--gpu-bandwidth-gb-s and --gpu-tflops"),
        ([*MILLION_USERS, *CHAT, *LLAMA_8B, *H100, "--measure", "http://127.0.0.1:9",
          "--gpu-tokens-per-second", "5"], 2,
         "error: give --measure or --gpu-tokens-per-second, not both"),
        ([*MILLION_USERS, *CHAT, *LLAMA_8B, *H100, "--model", "/nonexistent"], 2,
         "error: give --model or --layers/--kv-heads/--head-dim/--params, not both"),
        (["--from-usage", "sqlite:////nonexistent/tollway.db", *LLAMA_8B, *H100], 1,
         "error: no SQLite database at /nonexistent/tollway.db"),
        (["--from-usage", "nosuchdb://x", *LLAMA_8B, *H100], 1,
         "error: unsupported database URL 'nosuchdb://x': use sqlite:///path/to/tollway.db or "
         "postgresql+psycopg://user@host/db"),
        (["--from-usage", "sqlite:///x.db", "--prompt-tokens", "5", *LLAMA_8B, *H100], 2,
         "error: --from-usage reads the request shape; drop --prompt-tokens"),
        ([*MILLION_USERS, *CHAT, "--model", "/nonexistent", *H100], 1,
         "error: no checkpoint at /nonexistent: expected a Hugging Face directory with "
         "config.json or a .gguf file"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_a_nonzero_exit(args: list[str], code: int, message: str) -> None:
    result = runner.invoke(app, ["plan", *args])
    assert result.exit_code == code, result.output
    assert result.output.strip() == message
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_an_unreachable_database_is_one_line_without_its_password() -> None:
    url = "postgresql+psycopg://admin:hunter2@127.0.0.1:1/tollway"
    result = runner.invoke(app, ["plan", "--from-usage", url, *LLAMA_8B, *H100])
    assert result.exit_code == 1
    assert result.output.startswith("error: reading usage records failed: (psycopg.Operational")
    assert len(result.output.strip().splitlines()) == 1
    assert "hunter2" not in result.output


def test_an_unreachable_engine_to_measure_is_one_line() -> None:
    result = runner.invoke(
        app, ["plan", *MILLION_USERS, *CHAT, *LLAMA_8B, *H100, "--measure", "http://127.0.0.1:9"]
    )
    assert result.exit_code == 1
    assert result.output.startswith("error: cannot reach http://127.0.0.1:9")
    assert len(result.output.strip().splitlines()) == 1


def test_a_speed_no_gpu_group_reaches_is_one_line() -> None:
    result = runner.invoke(
        app, ["plan", *MILLION_USERS, *CHAT[:-1], "5000", *LLAMA_8B, "--gpu", "l4"]
    )
    assert result.exit_code == 1
    assert result.output.startswith("error: no GPU group of up to 8 l4 gives a stream 5,000")
