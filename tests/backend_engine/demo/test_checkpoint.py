from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from backend_engine.demo.checkpoint import write_demo_checkpoint
from backend_engine.demo.checkpoint_files import (
    ARCHITECTURES,
    DEMO_SHAPES,
    DEMO_SIZES,
    SPECIAL_TOKENS,
)
from model_files.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


def load_hf(path: Path) -> tuple[Any, dict[str, Any]]:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


def assert_clean_load(info: dict[str, Any]) -> None:
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), (key, info[key])


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return tensors


def digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_transformers_loads_every_architecture(
    demo_checkpoint: Callable[..., Path], architecture: str
) -> None:
    path = demo_checkpoint(architecture=architecture)
    model, info = load_hf(path)
    assert_clean_load(info)
    assert type(model).__name__ == architecture
    config = json.loads((path / "config.json").read_text())
    shape = DEMO_SHAPES["tiny"]
    assert config["architectures"] == [architecture]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["head_dim"] * config["num_attention_heads"] == config["hidden_size"]
    assert config["vocab_size"] == shape.vocab_size == model.config.vocab_size
    assert config["torch_dtype"] == "float32"
    names = set(read_tensors(path))
    has_bias = "model.layers.0.self_attn.q_proj.bias" in names
    assert has_bias == (architecture == "Qwen2ForCausalLM")
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    if architecture == "MistralForCausalLM":
        assert config["sliding_window"] is None
        assert model.config.sliding_window is None
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == config["vocab_size"]


def test_tokenizer_files(demo_checkpoint: Callable[..., Path]) -> None:
    path = demo_checkpoint()
    tok_json = json.loads((path / "tokenizer.json").read_text())
    pre = tok_json["pre_tokenizer"]["pretokenizers"]
    assert pre[0]["type"] == "Split"
    assert pre[0]["behavior"] == "Isolated"
    assert pre[1] == {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": False,
    }
    assert tok_json["decoder"]["type"] == "ByteLevel"
    tok = Tokenizer.from_pretrained(path)
    vocab_size = DEMO_SHAPES["tiny"].vocab_size
    special_ids = {t: tok.backend.token_to_id(t) for t in SPECIAL_TOKENS}
    assert sorted(special_ids.values()) == list(range(vocab_size - len(SPECIAL_TOKENS), vocab_size))
    generation = json.loads((path / "generation_config.json").read_text())
    eot, eot_text = special_ids["<|eot_id|>"], special_ids["<|end_of_text|>"]
    assert generation["eos_token_id"] == [eot, eot_text]
    assert generation["bos_token_id"] == special_ids["<|begin_of_text|>"] == tok.bos_token_id
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    first = write_demo_checkpoint(tmp_path / "a", size="tiny", seed=3, num_shards=2)
    second = write_demo_checkpoint(tmp_path / "b", size="tiny", seed=3, num_shards=2)
    assert digests(first) == digests(second)
    other = write_demo_checkpoint(tmp_path / "c", size="tiny", seed=4, num_shards=2)
    changed = {k for k, v in digests(other).items() if digests(first)[k] != v}
    assert changed == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}


def test_sharded_checkpoint(demo_checkpoint: Callable[..., Path]) -> None:
    path = demo_checkpoint(architecture="Qwen2ForCausalLM", num_shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(set(index["weight_map"].values())) == files
    assert not (path / "model.safetensors").exists()
    tensors = read_tensors(path)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    _, info = load_hf(path)
    assert_clean_load(info)
    single = read_tensors(demo_checkpoint(architecture="Qwen2ForCausalLM"))
    assert all(torch.equal(single[name], tensors[name]) for name in single)


def test_tied_embeddings_bf16_and_rope_scaling(demo_checkpoint: Callable[..., Path]) -> None:
    rope_scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    path = demo_checkpoint(tie_word_embeddings=True, dtype="bfloat16", rope_scaling=rope_scaling)
    tensors = read_tensors(path)
    assert "lm_head.weight" not in tensors
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    config = json.loads((path / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["rope_scaling"] == rope_scaling
    model, info = load_hf(path)
    assert_clean_load(info)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_logits_are_well_spread(demo_checkpoint: Callable[..., Path], architecture: str) -> None:
    path = demo_checkpoint(architecture=architecture)
    model, _ = load_hf(path)
    tok = Tokenizer.from_pretrained(path)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. 1234 + 5678 = 🙂 中文")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]  # [seq_len, vocab_size]
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert (gaps > 1e-3).float().mean() >= 0.9
    assert 1.0 < logits.std().item() < 5.0
    # Attention matters: the same last token after a different context gives other logits.
    other = tok.encode("Something else entirely. 1234 + 5678 = 🙂 中文")
    with torch.no_grad():
        other_logits = model(torch.tensor([other])).logits[0]
    assert (logits[-1] - other_logits[-1]).abs().max() > 0.1


def test_sizes() -> None:
    assert tuple(DEMO_SHAPES) == DEMO_SIZES

    def num_params(size: str) -> int:
        s = DEMO_SHAPES[size]
        kv = s.num_key_value_heads * s.head_dim
        per_layer = (
            2 * s.hidden_size**2
            + 2 * s.hidden_size * kv
            + 3 * s.hidden_size * (s.intermediate_size)
        )
        return s.num_hidden_layers * per_layer + 2 * s.vocab_size * s.hidden_size

    assert num_params("tiny") < 200_000
    assert 4e6 < num_params("small") < 6e6
    assert 18e6 < num_params("large") < 26e6


def test_small_checkpoint_loads(demo_checkpoint: Callable[..., Path]) -> None:
    path = demo_checkpoint(size="small", show_progress=True)
    _, info = load_hf(path)
    assert_clean_load(info)
    assert Tokenizer.from_pretrained(path).vocab_size == DEMO_SHAPES["small"].vocab_size


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": "huge"}, "size must be one of"),
        ({"architecture": "GPT2LMHeadModel"}, "architecture must be one of"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"num_shards": 0}, "num_shards must be between"),
        ({"rope_scaling": {"factor": 2.0}}, "rope_type"),
    ],
)
def test_invalid_arguments(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_demo_checkpoint(tmp_path, **{"size": "tiny", **kwargs})


def test_the_files_without_weights_are_the_checkpoints_own(
    demo_checkpoint: Callable[..., Path], demo_model_files: Callable[..., Path]
) -> None:
    """What ``demo_model_files`` writes without torch is byte for byte what the checkpoint
    holds, so the gateway's tests count tokens as the engine's checkpoint does."""
    for architecture in ARCHITECTURES:
        with_weights = demo_checkpoint(architecture=architecture, size="tiny")
        without = demo_model_files(architecture=architecture, size="tiny")
        assert sorted(p.name for p in without.iterdir()) == [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
        for file in without.iterdir():
            assert file.read_bytes() == (with_weights / file.name).read_bytes(), file.name
