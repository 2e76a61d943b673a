"""``tollway convert``: the Hugging Face directory written from a GGUF file is exact.

transformers loading the directory must compute the logits transformers computes loading the
GGUF file itself, its tokenizer must give the GGUF tokenizer's ids, and our ``LLM`` must load
it; on the shipped SmolLM2 file (tied output, Q4_1/Q8_0) and on a synthetic Llama (untied,
Q8_0) with a trained tokenizer. Bad inputs print one line and exit 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open
from typer.testing import CliRunner

from backend_engine.llm import LLM
from backend_engine.model_loader.gguf_convert import OUTPUT_FILES
from backend_engine.sampling_params import SamplingParams
from gateway.launcher.cli import app
from model_files.checkpoint import load_tokenizer
from model_files.tokenizer import Tokenizer
from tests.backend_engine.conftest import GreedyReference
from tests.model_files.gguf_tokenizer_files import (
    AWKWARD_TEXTS,
    CONVERSATIONS,
    add_byte_level_tokenizer,
    train_byte_level_bpe,
)
from tests.support.gguf_files import llama_cpp_permute

transformers = pytest.importorskip("transformers")

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2
HEAD_DIM = HIDDEN // HEADS
PROMPT_TEXT = "The capital of France is"
NUM_NEW_TOKENS = 4


def write_synthetic_model(path: Path) -> Path:
    """A tiny untied Llama with a trained llama-bpe tokenizer, 2-D weights in Q8_0, written
    under llama.cpp's tensor names with q/k rows permuted, as its converter writes them."""
    backend = train_byte_level_bpe("llama-bpe", vocab_size=320)
    vocab = backend.get_vocab_size()
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    tensors = {
        "token_embd.weight": w(vocab, HIDDEN),
        "output_norm.weight": w(HIDDEN),
        "output.weight": w(vocab, HIDDEN),
    }
    for i in range(LAYERS):
        tensors |= {
            f"blk.{i}.attn_norm.weight": w(HIDDEN),
            f"blk.{i}.attn_q.weight": llama_cpp_permute(w(HEADS * HEAD_DIM, HIDDEN), HEADS),
            f"blk.{i}.attn_k.weight": llama_cpp_permute(w(KV_HEADS * HEAD_DIM, HIDDEN), KV_HEADS),
            f"blk.{i}.attn_v.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": w(HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_norm.weight": w(HIDDEN),
            f"blk.{i}.ffn_gate.weight": w(FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": w(FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": w(HIDDEN, FFN),
        }
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(100_000.0)
    writer.add_vocab_size(vocab)
    add_byte_level_tokenizer(writer, backend, "llama-bpe", add_bos_token=True)
    for name, values in tensors.items():
        if values.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(values, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass(frozen=True)
class Converted:
    source: Path  # the GGUF file
    out_dir: Path  # what ``tollway convert`` wrote from it
    tokenizer: Tokenizer  # the GGUF file's own


@pytest.fixture(scope="module", params=["synthetic", "smollm2-file"])
def converted(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Converted:
    if request.param == "smollm2-file":
        source: Path = request.getfixturevalue("smollm2_gguf")
    else:
        source = write_synthetic_model(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    out_dir = tmp_path_factory.mktemp("converted") / "hf"
    result = CliRunner().invoke(app, ["convert", str(source), str(out_dir)])
    assert result.exit_code == 0, result.output
    return Converted(source, out_dir, load_tokenizer(source))


@torch.no_grad()
def test_transformers_computes_the_same_logits_from_the_directory(
    converted: Converted,
) -> None:
    source, out_dir = converted.source, converted.out_dir
    ids = torch.tensor([Tokenizer.from_pretrained(out_dir).encode(PROMPT_TEXT)])

    def logits(path: Path, **kwargs: Any) -> torch.Tensor:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, **kwargs
        )
        return model.eval()(ids).logits

    expected = logits(source.parent, gguf_file=source.name)
    torch.testing.assert_close(logits(out_dir), expected, rtol=1e-5, atol=1e-5)


def test_the_directorys_tokenizer_gives_the_gguf_tokenizers_ids(
    converted: Converted,
) -> None:
    out_dir, ours = converted.out_dir, converted.tokenizer
    hf = transformers.AutoTokenizer.from_pretrained(out_dir)
    reloaded = Tokenizer.from_pretrained(out_dir)
    for text in AWKWARD_TEXTS:
        for add_special_tokens in (True, False):
            expected = ours.encode(text, add_special_tokens=add_special_tokens)
            assert hf.encode(text, add_special_tokens=add_special_tokens) == expected, text
            assert reloaded.encode(text, add_special_tokens=add_special_tokens) == expected
    for messages in CONVERSATIONS:
        rendered = ours.apply_chat_template(messages)
        assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
            rendered
        )
        assert reloaded.encode_chat(messages) == ours.encode_chat(messages)
    assert (reloaded.bos_token_id, reloaded.eos_token_ids) == (
        ours.bos_token_id,
        ours.eos_token_ids,
    )


def test_our_engine_loads_the_directory(
    converted: Converted, transformers_greedy: GreedyReference
) -> None:
    """Our engine on the directory greedily continues a chat as transformers does on it."""
    out_dir = converted.out_dir
    prompt = Tokenizer.from_pretrained(out_dir).encode_chat(CONVERSATIONS[0])
    llm = LLM(model=str(out_dir), kv_cache_memory_bytes=16 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    [output] = llm.generate([prompt], greedy)
    assert [output.token_ids] == transformers_greedy(out_dir, [prompt], NUM_NEW_TOKENS)


def test_the_files_say_what_the_gguf_says(converted: Converted) -> None:
    source, out_dir = converted.source, converted.out_dir
    config = json.loads((out_dir / "config.json").read_text())
    tokenizer_config = json.loads((out_dir / "tokenizer_config.json").read_text())
    generation = json.loads((out_dir / "generation_config.json").read_text())
    ours = converted.tokenizer
    assert config["torch_dtype"] == "float32"
    assert config["model_type"] == "llama"
    assert generation["bos_token_id"] == config["bos_token_id"] == ours.bos_token_id
    assert tokenizer_config["chat_template"] == ours.chat_template
    assert tokenizer_config["model_max_length"] == config["max_position_embeddings"]
    assert tokenizer_config["add_bos_token"] is (source.name == "tiny.gguf")
    with safe_open(str(out_dir / "model.safetensors"), "pt") as weights:
        names = weights.keys()
    assert ("lm_head.weight" in names) is not config["tie_word_embeddings"]
    modes = {(out_dir / name).stat().st_mode & 0o777 for name in OUTPUT_FILES}
    assert len(modes) == 1  # the weights are not left private when the rest is readable


def test_dtype_chooses_the_weights_type(tmp_path: Path) -> None:
    source = write_synthetic_model(tmp_path / "tiny.gguf")
    out_dir = tmp_path / "bf16"
    result = CliRunner().invoke(app, ["convert", str(source), str(out_dir), "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    with safe_open(str(out_dir / "model.safetensors"), "pt") as weights:
        names = weights.keys()
        assert {weights.get_tensor(name).dtype for name in names} == {torch.bfloat16}
    assert json.loads((out_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"


def _one_line_error(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["convert", *args])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert message in lines[0], result.output
    assert "Traceback" not in result.output


def test_bad_inputs_print_one_line(tmp_path: Path) -> None:
    source = write_synthetic_model(tmp_path / "tiny.gguf")
    _one_line_error([str(tmp_path / "absent.gguf"), str(tmp_path / "a")], "no GGUF file at")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(source.read_bytes()[:5000])
    _one_line_error([str(truncated), str(tmp_path / "b")], "not a readable GGUF file")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    _one_line_error([str(source), str(busy)], "is not empty (--force")
    _one_line_error([str(source), str(tmp_path / "c"), "--dtype", "int3"], "dtype must be one of")
    assert not (tmp_path / "a").exists()
    assert not (tmp_path / "b").exists()
    forced = CliRunner().invoke(app, ["convert", str(source), str(busy), "--force"])
    assert forced.exit_code == 0, forced.output
    assert (busy / "keep.txt").read_text() == "mine"
    assert (busy / "config.json").is_file()
