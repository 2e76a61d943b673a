"""Reading safetensors checkpoints: single file, shards, dtypes and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from backend_engine.model_loader.weights import (
    check_weight_names,
    iter_weights,
    resolve_dtype,
    weight_files,
)
from model_files.model_config import ModelConfig


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(4, 3, generator=gen, dtype=torch.float32) for i in range(5)}


def write_sharded(root: Path, named: dict[str, torch.Tensor]) -> None:
    names = sorted(named)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: named[k] for k in keys}, str(root / file))
        weight_map |= dict.fromkeys(keys, file)
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_single_file_roundtrip(tmp_path: Path) -> None:
    named = tensors()
    save_file(named, str(tmp_path / "model.safetensors"))
    loaded = dict(iter_weights(tmp_path, torch.float32))
    assert loaded.keys() == named.keys()
    for name, tensor in named.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize("show_progress", [False, True])
def test_sharded_with_dtype_conversion(tmp_path: Path, show_progress: bool) -> None:
    named = tensors()
    write_sharded(tmp_path, named)
    assert [p.name for p in weight_files(tmp_path)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    loaded = dict(iter_weights(tmp_path, torch.bfloat16, show_progress=show_progress))
    assert loaded.keys() == named.keys()
    for name, tensor in named.items():
        assert loaded[name].dtype == torch.bfloat16
        torch.testing.assert_close(loaded[name], tensor.bfloat16(), rtol=0, atol=0)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    write_sharded(tmp_path, tensors())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors"):
        list(iter_weights(tmp_path, torch.float32))


def test_no_weights_at_all(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        weight_files(tmp_path)


def test_resolve_dtype() -> None:
    config = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 8,
            "hidden_size": 8,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "torch_dtype": "bfloat16",
        }
    )
    assert resolve_dtype("auto", config) == torch.bfloat16
    assert resolve_dtype("float32", config) == torch.float32
    assert resolve_dtype("float16", config) == torch.float16
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8", config)


def test_check_weight_names_lists_both_sides() -> None:
    check_weight_names(set(), set())
    with pytest.raises(ValueError, match=r"missing tensors: a, b; unexpected tensors: z"):
        check_weight_names({"b", "a"}, {"z"})
