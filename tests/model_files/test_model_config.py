"""ModelConfig parsing from config.json, both transformers 4 and 5 spellings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from model_files.model_config import ModelConfig

LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def write(tmp_path: Path, raw: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_llama3_v4_style(tmp_path: Path) -> None:
    config = ModelConfig.from_pretrained(write(tmp_path, LLAMA))
    assert config.architecture == "LlamaForCausalLM"
    assert config.head_dim == 64
    assert config.num_key_value_heads == 8
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is not None
    assert config.rope_scaling["rope_type"] == "llama3"
    assert config.rope_scaling["factor"] == 32.0
    assert config.tie_word_embeddings
    assert not config.attention_bias
    assert config.torch_dtype == "bfloat16"
    assert config.bos_token_id == 128000
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert config.max_model_len == 131072


def test_rope_parameters_v5_style_and_defaults(tmp_path: Path) -> None:
    raw = {k: v for k, v in LLAMA.items() if k not in ("rope_theta", "rope_scaling")}
    raw |= {"rope_parameters": {**LLAMA["rope_scaling"], "rope_theta": 500000.0}}
    del raw["num_key_value_heads"], raw["torch_dtype"]
    raw["dtype"] = "float16"
    raw["eos_token_id"] = 2
    config = ModelConfig.from_pretrained(write(tmp_path, raw))
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {**LLAMA["rope_scaling"]}
    assert config.num_key_value_heads == 32  # defaults to num_attention_heads
    assert config.torch_dtype == "float16"
    assert config.eos_token_ids == (2,)


def test_default_rope_means_no_scaling(tmp_path: Path) -> None:
    raw = LLAMA | {"rope_scaling": None, "rope_theta": 10000.0}
    assert ModelConfig.from_pretrained(write(tmp_path, raw)).rope_scaling is None
    raw = LLAMA | {
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }
    config = ModelConfig.from_pretrained(write(tmp_path, raw))
    assert config.rope_scaling is None
    assert config.rope_theta == 1e6


def test_unsupported_rope_type(tmp_path: Path) -> None:
    raw = LLAMA | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_pretrained(write(tmp_path, raw))


def test_a_model_the_engine_does_not_run_is_read_as_given_unchecked() -> None:
    """``check_support=False`` (the capacity planner's reading): the same keys, nothing refused."""
    raw = LLAMA | {
        "architectures": ["GemmaForCausalLM"],
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
        "torch_dtype": "float8_e4m3fn",
    }
    with pytest.raises(ValueError, match="GemmaForCausalLM"):
        ModelConfig.from_dict(raw)
    config = ModelConfig.from_dict(raw, check_support=False)
    assert config.architecture == "GemmaForCausalLM"
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 4.0}
    assert config.torch_dtype == "float8_e4m3fn"
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (16, 8, 64)


def test_qwen2_has_bias_and_ignores_disabled_sliding_window(tmp_path: Path) -> None:
    raw = LLAMA | {
        "architectures": ["Qwen2ForCausalLM"],
        "sliding_window": 4096,
        "use_sliding_window": False,
    }
    config = ModelConfig.from_pretrained(write(tmp_path, raw))
    assert config.attention_bias
    assert config.sliding_window is None


def test_llama_attention_bias_key(tmp_path: Path) -> None:
    config = ModelConfig.from_pretrained(write(tmp_path, LLAMA | {"attention_bias": True}))
    assert config.attention_bias


def test_mistral_sliding_window_caps_max_model_len(tmp_path: Path) -> None:
    raw = LLAMA | {
        "architectures": ["MistralForCausalLM"],
        "sliding_window": 4096,
        "max_position_embeddings": 32768,
    }
    config = ModelConfig.from_pretrained(write(tmp_path, raw))
    assert config.max_model_len == 4096
    assert config.check_max_model_len(None) == 4096
    assert config.check_max_model_len(2048) == 2048
    with pytest.raises(ValueError, match="sliding window"):
        config.check_max_model_len(8192)
    no_window = ModelConfig.from_pretrained(write(tmp_path, raw | {"sliding_window": None}))
    assert no_window.max_model_len == 32768


def test_unsupported_architecture_names_it_and_lists_supported(tmp_path: Path) -> None:
    raw = LLAMA | {"architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        ModelConfig.from_pretrained(write(tmp_path, raw))
    assert "LlamaForCausalLM" in str(info.value)
    assert "Qwen2ForCausalLM" in str(info.value)


def test_missing_config_names_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "config.json")):
        ModelConfig.from_pretrained(tmp_path)


def test_heads_must_divide(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig.from_pretrained(write(tmp_path, LLAMA | {"num_key_value_heads": 5}))
