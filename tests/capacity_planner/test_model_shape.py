"""A model's shape from a checkpoint, without torch: config.json (+ safetensors headers) or
a GGUF file's metadata and tensor infos."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from capacity_planner.model_shape import estimate_params, shape_from_checkpoint
from model_files.model_config import ModelConfig
from tests.support.gguf_files import HEAD_DIM, KV_HEADS, LAYERS, hf_tensors, write_gguf

# meta-llama/Llama-3.1-8B's config.json (the fields the estimate reads).
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


def test_the_estimate_from_a_config_is_llama_3_1_8b_s_published_count() -> None:
    # The model card's parameter count: 8,030,261,248.
    assert estimate_params(ModelConfig.from_dict(LLAMA_3_1_8B)) == 8_030_261_248


def test_a_config_only_directory_gives_the_shape_and_estimates_the_params(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
    shape = shape_from_checkpoint(tmp_path)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (32, 8, 128)
    assert shape.num_params == 8_030_261_248
    assert shape.source == str(tmp_path)


def test_safetensors_headers_count_the_params(tmp_path: Path) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    tensors = hf_tensors()
    names = sorted(tensors)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):  # two shards
        safetensors_numpy.save_file(
            {n: tensors[n] for n in part}, str(tmp_path / f"model-{i}.safetensors")
        )
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": LAYERS}
    config |= {"num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = shape_from_checkpoint(tmp_path)
    assert shape.num_params == sum(t.size for t in tensors.values())


def test_a_demo_checkpoint_s_params_are_its_weights(demo_checkpoint: Callable[..., Path]) -> None:
    """A real checkpoint the engine writes (safetensors): the headers' count is every loaded
    tensor's size, and the Llama-style estimate from its config.json agrees with it."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    path = demo_checkpoint(size="tiny")
    loaded = [
        tensor
        for file in path.glob("*.safetensors")
        for tensor in safetensors_numpy.load_file(str(file)).values()
    ]
    shape = shape_from_checkpoint(path)
    assert shape.num_params == sum(t.size for t in loaded) > 0
    assert estimate_params(ModelConfig.from_pretrained(path)) == shape.num_params


def test_the_estimate_counts_qwen2_s_attention_biases() -> None:
    """Qwen2.5-0.5B's config (biases on q, k and v by default; tied embeddings): its model
    card's 494,032,768 parameters ("0.49B")."""
    qwen = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    }
    assert estimate_params(ModelConfig.from_dict(qwen)) == 494_032_768
    assert estimate_params(ModelConfig.from_dict({**qwen, "attention_bias": False})) < 494_032_768


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_a_gguf_file_gives_its_shape_and_param_count(tmp_path: Path, qtype: Q) -> None:
    tensors = hf_tensors()
    path = write_gguf(tmp_path / "model.gguf", tensors, qtype=qtype)
    shape = shape_from_checkpoint(path)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (LAYERS, KV_HEADS, HEAD_DIM)
    assert shape.num_params == sum(t.size for t in tensors.values())
    # The same count as the Llama-style estimate from its config.
    config = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS,
        "intermediate_size": 128,
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
    }
    assert estimate_params(ModelConfig.from_dict(config, check_support=False)) == shape.num_params


@pytest.mark.parametrize(("qtype", "bits"), [(Q.F32, 32.0), (Q.Q8_0, 8.5), (Q.Q4_1, 5.0)])
def test_a_gguf_file_says_how_it_stores_its_weights(tmp_path: Path, qtype: Q, bits: float) -> None:
    """2-D weights in ``qtype`` (8.5 bits a weight for Q8_0: 32 int8 and an fp16 scale; 5 for
    Q4_1), norms in F32: the bytes are the tensors' as stored, not a format's nominal size."""
    tensors = hf_tensors()
    shape = shape_from_checkpoint(write_gguf(tmp_path / "model.gguf", tensors, qtype=qtype))
    assert shape.stored is not None
    norms = sum(t.size for name, t in tensors.items() if t.ndim == 1)
    matrices = shape.num_params - norms
    assert shape.stored.num_bytes == matrices * bits / 8 + norms * 4
    share = 1.0 if qtype == Q.F32 else matrices / shape.num_params  # the norms' F32 apart
    assert shape.stored.formats[0] == (qtype.name, share)
    assert sum(share for _, share in shape.stored.formats) == pytest.approx(1.0)


def test_the_bundled_smollm2_gguf(smollm2_gguf: Path) -> None:
    shape = shape_from_checkpoint(smollm2_gguf)
    # SmolLM2-135M: 30 layers, 3 KV heads of 64; 134.5 million parameters (tied embeddings).
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (30, 3, 64)
    assert round(shape.num_params / 1e6, 1) == 134.5
    # Its quantization, detected: mostly Q4_1, some Q8_0, the norms in F32.
    assert shape.stored is not None
    assert [name for name, _ in shape.stored.formats] == ["Q4_1", "Q8_0", "F32"]
    assert 5.0 < 8 * shape.stored.num_bytes / shape.num_params < 6.0
    assert shape.stored.describe(shape.num_params).endswith("bits a weight")


def test_a_config_the_engine_does_not_serve_still_gives_its_shape(tmp_path: Path) -> None:
    """The planner plans any Llama-style decoder: an architecture, RoPE type or dtype the engine
    refuses, inside a multimodal wrapper, is read as given."""
    text = LLAMA_3_1_8B | {
        "architectures": ["MistralNemoForCausalLM"],
        "head_dim": 64,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
        "torch_dtype": "float8_e4m3fn",
    }
    wrapper = {"architectures": ["LlavaForConditionalGeneration"], "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    shape = shape_from_checkpoint(tmp_path)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (32, 8, 64)


def test_a_gguf_file_the_engine_does_not_serve_still_gives_its_shape(tmp_path: Path) -> None:
    """Llama 3's RoPE frequency factors and an architecture the engine does not run."""
    tensors = hf_tensors()
    factors = {"rope_freqs.weight": (np.ones(HEAD_DIM // 2, dtype=np.float32), Q.F32)}
    for arch in ("llama", "gemma"):
        path = write_gguf(tmp_path / f"{arch}.gguf", tensors, arch=arch, raw=factors)
        shape = shape_from_checkpoint(path)
        dims = (shape.num_layers, shape.num_kv_heads, shape.head_dim)
        assert dims == (LAYERS, KV_HEADS, HEAD_DIM)
        assert shape.num_params == sum(t.size for t in tensors.values()) + HEAD_DIM // 2


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p, "no checkpoint at .*: expected a Hugging Face directory"),
        (lambda p: (p / "config.json").write_text("{nope") and p, "is not readable JSON"),
        (lambda p: (p / "config.json").write_text("{}") and p, "does not describe a model shape"),
        (lambda p: (p / "x.gguf").write_bytes(b"GGUF\x00") and p / "x.gguf", "not a readable GGUF"),
    ],
)
def test_an_unreadable_checkpoint_is_refused_by_name(
    tmp_path: Path, make: Callable[[Path], Path], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        shape_from_checkpoint(make(tmp_path))
