"""``tollway convert SRC OUT.gguf``: a GGUF file from a GGUF file or a Hugging Face directory.

Round trips through our own loader: float32 gives back the same values, quantized files hold
exactly the blocks ``weight_quantization`` makes, ``hf_config`` reads the same config, the
tokenizer encodes the same; a tiny Hugging Face checkpoint written as GGUF gives our engine
the same greedy tokens. Bad inputs print one line and leave no file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from typer.testing import CliRunner

from backend_engine.llm import LLM
from backend_engine.model_loader.gguf_export import convert_to_gguf, gguf_name, permute_rows
from backend_engine.model_loader.gguf_weights import hf_name, iter_gguf_weights, unpermute_rows
from backend_engine.model_loader.weight_quantization import quantize_tensor
from backend_engine.model_loader.weights import iter_weights
from backend_engine.models import gptq_hessians
from backend_engine.sampling_params import SamplingParams
from gateway.launcher.cli import app
from kernels.cpu_quant_linear import GGUFBlockWeight
from model_files.checkpoint import Checkpoint, load_tokenizer
from model_files.gguf_metadata import hf_config, metadata_value, open_gguf
from model_files.gguf_tokenizer import read_vocabulary
from model_files.model_config import ModelConfig
from tests.model_files.gguf_tokenizer_files import AWKWARD_TEXTS, CONVERSATIONS
from tests.support.gguf_files import HEADS, KV_HEADS, hf_tensors, write_gguf

NUM_NEW_TOKENS = 6


def gguf_source(
    path: Path, *, qtype: Q = Q.F32, bias: bool = False, tied: bool = False, arch: str = "llama"
) -> Path:
    tensors = hf_tensors(bias=bias, tied=tied, scale=0.1)
    return write_gguf(path, tensors, arch=arch, qtype=qtype, tokenizer_pre="smollm")


def floats(path: Path) -> dict[str, torch.Tensor]:
    return dict(iter_gguf_weights(open_gguf(path), torch.float32))


def stored(path: Path) -> dict[str, tuple[Q, np.ndarray]]:
    """Each tensor's type and stored data (rows first), q/k rows unpermuted (llama), by HF
    name."""
    reader = GGUFReader(path)
    is_llama = metadata_value(reader, "general.architecture") == "llama"
    heads = {"attn_q": HEADS, "attn_k": KV_HEADS} if is_llama else {}
    tensors = {}
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if kind in heads:
            data = unpermute_rows(data, heads[kind])
        tensors[hf_name(tensor.name)] = (Q(tensor.tensor_type), data)
    return tensors


@pytest.mark.parametrize(("bias", "tied"), [(False, False), (True, True)])
def test_a_float32_round_trip_gives_back_the_same_values(
    tmp_path: Path, bias: bool, tied: bool
) -> None:
    source = gguf_source(tmp_path / "src.gguf", qtype=Q.Q8_0, bias=bias, tied=tied)
    out = convert_to_gguf(source, tmp_path / "out.gguf")
    expected, got = floats(source), floats(out)
    assert got.keys() == expected.keys()
    for name, values in expected.items():
        assert torch.equal(got[name], values), name
    assert hf_config(open_gguf(out)) == hf_config(open_gguf(source))
    assert read_vocabulary(open_gguf(out)) == read_vocabulary(open_gguf(source))
    # llama.cpp's layout as written by its converter: permuted q/k rows, F32 everywhere
    assert {kind for kind, _ in stored(out).values()} == {Q.F32}
    raw = {t.name: np.array(t.data) for t in GGUFReader(source).tensors}
    out_raw = {t.name: np.array(t.data) for t in GGUFReader(out).tensors}
    dequantized_q = floats(source)["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert np.array_equal(out_raw["blk.0.attn_q.weight"], permute_rows(dequantized_q, HEADS))
    assert raw.keys() == out_raw.keys()
    assert ("output.weight" in out_raw) is not tied


@pytest.mark.parametrize(("quantization", "group_size"), [("int8", 32), ("int4", 32), ("int4", 64)])
def test_a_quantized_file_holds_the_blocks_of_the_scheme(
    tmp_path: Path, quantization: str, group_size: int
) -> None:
    source = gguf_source(tmp_path / "src.gguf", bias=True)
    out = convert_to_gguf(
        source, tmp_path / "out.gguf", quantization=quantization, group_size=group_size
    )
    reader = open_gguf(out)
    assert hf_config(reader) == hf_config(open_gguf(source))
    expected_file_type = 7 if quantization == "int8" else 3  # MOSTLY_Q8_0, MOSTLY_Q4_1
    assert metadata_value(reader, "general.file_type") == expected_file_type
    scheme_type = Q.Q8_0 if quantization == "int8" else Q.Q4_1
    for name, value in floats(source).items():
        kind, data = stored(out)[name]
        quantized = quantize_tensor(name, value, quantization, group_size, "cpu")
        if isinstance(quantized, GGUFBlockWeight):
            is_decoder_linear = name.startswith("model.layers.")
            assert kind == (scheme_type if is_decoder_linear else Q.Q8_0), name
            assert np.array_equal(data, quantized.blocks.numpy()), name
        else:  # norms and biases
            assert isinstance(quantized, torch.Tensor)
            assert kind == Q.F32, name
            assert np.array_equal(data, quantized.numpy()), name


def test_dtype_chooses_the_matrices_type(tmp_path: Path) -> None:
    source = gguf_source(tmp_path / "src.gguf")
    for dtype, kind, file_type in (("float16", Q.F16, 1), ("bfloat16", Q.BF16, 32)):
        out = convert_to_gguf(source, tmp_path / f"{dtype}.gguf", dtype=dtype)
        assert metadata_value(open_gguf(out), "general.file_type") == file_type
        expected = floats(source)
        for name, (stored_kind, _) in stored(out).items():
            assert stored_kind == (kind if expected[name].dim() == 2 else Q.F32), name
        got = floats(out)
        torch_dtype = getattr(torch, dtype)
        for name, values in expected.items():
            rounded = values.to(torch_dtype).float() if values.dim() == 2 else values
            assert torch.equal(got[name], rounded), name


def test_qwen2_is_written_unpermuted_with_its_biases(tmp_path: Path) -> None:
    source = gguf_source(tmp_path / "src.gguf", bias=True, arch="qwen2")
    out = convert_to_gguf(source, tmp_path / "out.gguf", quantization="int8")
    assert hf_config(open_gguf(out)) == hf_config(open_gguf(source))
    assert hf_config(open_gguf(out))["attention_bias"] is True
    for name, value in floats(source).items():
        _, data = stored(out)[name]  # as written: qwen2's rows are not permuted
        quantized = quantize_tensor(name, value, "int8", 32, "cpu")
        expected = quantized.blocks if isinstance(quantized, GGUFBlockWeight) else quantized
        assert isinstance(expected, torch.Tensor)
        assert np.array_equal(data, expected.numpy()), name


def test_the_names_are_llama_cpps() -> None:
    names = hf_tensors(bias=True)
    assert [hf_name(gguf_name(name)) for name in names] == list(names)
    rows = np.arange(4 * 16 * 3).reshape(4 * 16, 3)
    assert np.array_equal(unpermute_rows(permute_rows(rows, 4), 4), rows)
    assert not np.array_equal(permute_rows(rows, 4), rows)


# -- from a Hugging Face directory ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from backend_engine.demo.checkpoint import write_demo_checkpoint

    return write_demo_checkpoint(tmp_path_factory.mktemp("tiny-hf"), size="tiny")


def _greedy(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model=str(model), kv_cache_memory_bytes=16 << 20, show_progress=False)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    return [output.token_ids for output in llm.generate(prompts, greedy)]


def test_a_hugging_face_directory_becomes_an_equivalent_gguf_file(
    tiny_hf: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tiny.gguf"
    result = CliRunner().invoke(app, ["convert", str(tiny_hf), str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out} from {tiny_hf} (float32)" in result.output
    # the config hf_config reads back is the directory's (the numbers GGUF stores as float32)
    raw = json.loads((tiny_hf / "config.json").read_text())
    expected, got = ModelConfig.from_dict(raw), ModelConfig.from_dict(hf_config(open_gguf(out)))
    assert got.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-6)
    same: dict[str, Any] = {"rms_norm_eps": expected.rms_norm_eps, "eos_token_ids": ()}
    assert got.__class__(**{**got.__dict__, **same}) == expected.__class__(
        **{**expected.__dict__, **same}
    )
    # the same weights, the same tokenizer
    weights = dict(iter_weights(tiny_hf, torch.float32))
    assert floats(out).keys() == weights.keys()
    for name, values in floats(out).items():
        assert torch.equal(values, weights[name]), name
    ours, theirs = load_tokenizer(out), load_tokenizer(tiny_hf)
    for text in AWKWARD_TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
    for messages in CONVERSATIONS:
        assert ours.encode_chat(messages) == theirs.encode_chat(messages)
    assert (ours.bos_token_id, ours.eos_token_ids) == (theirs.bos_token_id, theirs.eos_token_ids)
    # and our engine continues a chat the same way from either
    prompts = [theirs.encode_chat(CONVERSATIONS[0]), theirs.encode("The capital of France is")]
    assert _greedy(out, prompts) == _greedy(tiny_hf, prompts)


@pytest.mark.parametrize("calibration", ["gptq", "rtn"])
def test_a_hugging_face_directory_quantized(
    tiny_hf: Path, tmp_path: Path, calibration: str
) -> None:
    out = tmp_path / "tiny-q4.gguf"
    args = ["convert", str(tiny_hf), str(out), "--quantization", "int4", "--group-size", "64"]
    result = CliRunner().invoke(app, [*args, "--calibration", calibration])
    assert result.exit_code == 0, result.output
    assert f"(int4, groups of 64, {calibration})" in result.output
    weights = dict(iter_weights(tiny_hf, torch.float32))
    checkpoint = Checkpoint(tiny_hf)
    hessians = gptq_hessians(checkpoint, checkpoint.check(), "cpu") if calibration == "gptq" else {}
    for name, (_, data) in stored(out).items():
        quantized = quantize_tensor(name, weights[name], "int4", 64, "cpu", hessians.get(name))
        expected = quantized.blocks if isinstance(quantized, GGUFBlockWeight) else quantized
        assert isinstance(expected, torch.Tensor)
        assert np.array_equal(data, expected.numpy()), name
    assert _greedy(out, [[5, 6, 7, 8]])[0]  # it loads and generates


# -- refusals ---------------------------------------------------------------------------------


def _one_line_error(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["convert", *args])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert message in lines[0], result.output
    assert "Traceback" not in result.output


def test_bad_conversions_print_one_line_and_leave_no_file(
    tmp_path: Path, tiny_hf: Path, demo_checkpoint: Any
) -> None:
    source = gguf_source(tmp_path / "src.gguf")
    out = tmp_path / "out.gguf"
    _one_line_error([str(source), str(out), "--quantization", "int3"], "quantization must be")
    _one_line_error([str(source), str(out), "--dtype", "int3"], "dtype must be one of")
    _one_line_error(
        [str(source), str(out), "--quantization", "int8", "--group-size", "64"],
        "--group-size goes with --quantization int4",
    )
    _one_line_error(
        [str(source), str(out), "--quantization", "int4", "--group-size", "48"],
        "group size must be 32 or 64",
    )
    _one_line_error(
        [str(source), str(tmp_path / "dir"), "--quantization", "int8"],
        "--quantization writes a GGUF file: OUT must end in .gguf",
    )
    _one_line_error([str(tiny_hf), str(tmp_path / "dir")], "can be converted to a .gguf file")
    _one_line_error(
        [str(source), str(out), "--quantization", "int4", "--calibration", "awq"],
        "--calibration must be one of gptq, rtn",
    )
    qwen2 = demo_checkpoint("Qwen2ForCausalLM")  # its tokenizer NFC-normalizes
    _one_line_error([str(qwen2), str(out)], "NFC normalizer has no GGUF equivalent")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.gguf"]
    out.write_bytes(b"mine")
    _one_line_error([str(source), str(out)], "exists (--force replaces a file)")
    forced = CliRunner().invoke(app, ["convert", str(source), str(out), "--force"])
    assert forced.exit_code == 0, forced.output
    assert hf_config(open_gguf(out)) == hf_config(open_gguf(source))


def test_a_config_gguf_cannot_say_is_refused(tmp_path: Path, tiny_hf: Path) -> None:
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for file in tiny_hf.iterdir():
        (scaled / file.name).symlink_to(file)
    (scaled / "config.json").unlink()
    raw = json.loads((tiny_hf / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (scaled / "config.json").write_text(json.dumps(raw))
    _one_line_error([str(scaled), str(tmp_path / "x.gguf")], "linear RoPE scaling")
    assert not (tmp_path / "x.gguf").exists()
