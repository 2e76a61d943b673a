"""CausalLM against Hugging Face transformers on tiny random checkpoints.

Every comparison runs our model through a real paged KV cache with shuffled,
non-contiguous block tables: a full prefill, a prefix then decodes one by one, chunked
prefill after a cached prefix, and mixed decode + prefill batches. With packed linears on
the CPU, decode-only steps run every layer in one native call (``kernels.cpu_decoder``),
checked against transformers here too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from backend_engine.models import CausalLM, load_model
from backend_engine.models.attention_metadata import AttentionMetadata
from backend_engine.models.packed_linear import pack_linears
from kernels import cpu_decoder
from model_files.model_config import ModelConfig

BLOCK_SIZE = 16
NUM_BLOCKS = 64
ATOL = 1e-4

SMALL: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CHECKPOINTS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama_tied": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
    "llama3_rope": (
        LlamaConfig,
        LlamaForCausalLM,
        {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
    ),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


def make_checkpoint(root: Path, kind: str, max_shard_size: str | None = None) -> Path:
    config_cls, model_cls, extra = CHECKPOINTS[kind]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**SMALL, **extra))
    with torch.no_grad():  # larger than HF's init so logits differ visibly; random biases
        for name, p in hf.named_parameters():
            p.copy_(
                1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p)
            )
    path = root / kind
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.save_pretrained(path, **kwargs)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    paths = {kind: make_checkpoint(root, kind) for kind in CHECKPOINTS}
    paths["llama_sharded"] = make_checkpoint(root / "sharded", "llama", max_shard_size="50KB")
    return paths


def hf_logits(path: Path, input_ids: list[int]) -> torch.Tensor:  # [len, vocab]
    kind = path.name
    _, model_cls, _ = CHECKPOINTS[kind]
    hf = model_cls.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([input_ids])).logits[0].float()


@dataclass
class Sequence:
    tokens: list[int]
    block_table: list[int]
    num_computed: int = 0


@dataclass
class PagedRunner:
    """A minimal model runner: allocates shuffled blocks and builds the packed metadata."""

    model: CausalLM
    gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(1))

    def __post_init__(self) -> None:
        c = self.model.config
        shape = (NUM_BLOCKS, BLOCK_SIZE, c.num_key_value_heads, c.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.model.dtype), torch.zeros(shape, dtype=self.model.dtype))
            for _ in range(c.num_hidden_layers)
        ]
        self.free = torch.randperm(NUM_BLOCKS, generator=self.gen).tolist()

    def new_sequence(self, tokens: list[int]) -> Sequence:
        num_blocks = -(-len(tokens) // BLOCK_SIZE)
        return Sequence(tokens, [self.free.pop() for _ in range(num_blocks)])

    def step(self, work: list[tuple[Sequence, int]]) -> list[torch.Tensor]:
        """Run ``num_new`` tokens of each sequence (decodes = 1 token, listed first)."""
        ids, positions, slots = [], [], []
        for seq, num_new in work:
            for pos in range(seq.num_computed, seq.num_computed + num_new):
                ids.append(seq.tokens[pos])
                positions.append(pos)
                slots.append(seq.block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        num_decodes = 0
        while num_decodes < len(work) and work[num_decodes][1] == 1:
            num_decodes += 1
        decodes, prefills = work[:num_decodes], work[num_decodes:]

        def tables(part: list[tuple[Sequence, int]]) -> torch.Tensor:
            width = max((len(s.block_table) for s, _ in part), default=1)
            return torch.tensor(
                [s.block_table + [0] * (width - len(s.block_table)) for s, _ in part],
                dtype=torch.int32,
            ).view(len(part), width)

        query_lens = [n for _, n in prefills]
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decode_tokens=num_decodes,
            decode_block_tables=tables(decodes),
            decode_seq_lens=torch.tensor(
                [s.num_computed + 1 for s, _ in decodes], dtype=torch.int32
            ),
            prefill_block_tables=tables(prefills),
            prefill_cu_seqlens_q=torch.tensor(
                [0, *torch.tensor(query_lens, dtype=torch.int64).cumsum(0).tolist()],
                dtype=torch.int32,
            ),
            prefill_seq_lens=torch.tensor(
                [s.num_computed + n for s, n in prefills], dtype=torch.int32
            ),
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, md)
        logits = self.model.compute_logits(hidden)  # [num_tokens, vocab]
        out, start = [], 0
        for seq, num_new in work:
            out.append(logits[start : start + num_new])
            start += num_new
            seq.num_computed += num_new
        return out


def prompt(length: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (length,), generator=gen).tolist()


def load(path: Path, dtype: str = "float32") -> CausalLM:
    return load_model(path, ModelConfig.from_pretrained(path), dtype, "cpu")


@pytest.mark.parametrize("kind", [*CHECKPOINTS, "llama_sharded"])
def test_full_prefill_matches_hf(checkpoints: dict[str, Path], kind: str) -> None:
    path = checkpoints[kind]
    tokens = prompt(45)
    runner = PagedRunner(load(path))
    (logits,) = runner.step([(runner.new_sequence(tokens), len(tokens))])
    torch.testing.assert_close(logits, hf_logits(path, tokens), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3_rope"])
def test_prefix_then_decode_then_chunk_matches_hf(checkpoints: dict[str, Path], kind: str) -> None:
    path = checkpoints[kind]
    tokens = prompt(60, seed=1)
    expected = hf_logits(path, tokens)  # [60, vocab]
    runner = PagedRunner(load(path))
    seq = runner.new_sequence(tokens)
    got = runner.step([(seq, 13)])  # prefix ends mid-block
    for _ in range(7):  # crosses the block boundary at 16
        got += runner.step([(seq, 1)])
    got += runner.step([(seq, 18)])  # chunked prefill on top of a cached prefix
    while seq.num_computed < len(tokens):
        got += runner.step([(seq, 1)])
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=ATOL)


def test_mixed_decode_and_prefill_batch_matches_hf(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["llama"]
    prompts = [prompt(n, seed=10 + n) for n in (20, 33, 8, 40)]
    expected = [hf_logits(path, p) for p in prompts]
    runner = PagedRunner(load(path))
    a, b, c, d = (runner.new_sequence(p) for p in prompts)
    first = runner.step([(a, 17), (b, 30)])  # two prefills
    second = runner.step([(a, 1), (b, 1), (c, 5), (d, 9)])  # 2 decodes, 2 prefills
    third = runner.step([(a, 1), (c, 1), (b, 2), (d, 31)])  # b resumes with a 2-token chunk
    got = {
        "a": torch.cat([first[0], second[0], third[0]]),
        "b": torch.cat([first[1], second[1], third[2]]),
        "c": torch.cat([second[2], third[1]]),
        "d": torch.cat([second[3], third[3]]),
    }
    for key, exp in zip("abcd", expected, strict=True):
        n = got[key].shape[0]
        torch.testing.assert_close(got[key], exp[:n], atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_native_decoder_steps_match_hf(
    checkpoints: dict[str, Path], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoints[kind]
    prompts = [prompt(n, seed=20 + n) for n in (26, 19, 40)]
    expected = [hf_logits(path, p) for p in prompts]
    model = load(path)
    pack_linears(model)
    runner = PagedRunner(model)
    if not model.bind_native_decoder(runner.kv_caches):
        pytest.skip("the native decoder cannot run here (no compiler, or another oneDNN layout)")
    native_steps: list[int] = []
    call = cpu_decoder.NativeDecoder.__call__
    monkeypatch.setattr(
        cpu_decoder.NativeDecoder,
        "__call__",
        lambda self, *args: native_steps.append(args[0].shape[0]) or call(self, *args),
    )
    seqs = [runner.new_sequence(p) for p in prompts]
    got: list[list[torch.Tensor]] = [[] for _ in seqs]

    def step(work: list[tuple[int, int]]) -> None:  # (sequence, new tokens)
        logits = runner.step([(seqs[i], n) for i, n in work])
        for (i, _), rows in zip(work, logits, strict=True):
            got[i].append(rows)

    step([(0, 12), (1, 12), (2, 12)])  # prefills: layer by layer
    step([(0, 1), (1, 1), (2, 9)])  # mixed: likewise
    while seqs[2].num_computed < len(prompts[2]):  # decodes only: the native decoder
        step([(i, 1) for i, s in enumerate(seqs) if s.num_computed < len(s.tokens)])
    assert native_steps[:2] == [3, 3]
    assert native_steps[-1] == 1
    assert sum(native_steps) == sum(map(len, prompts)) - 3 * 12 - 11
    for rows, exp in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.cat(rows), exp, atol=ATOL, rtol=ATOL)


def test_bf16_load_runs_close_to_fp32(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["qwen2"]
    model = load(path, "bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    tokens = prompt(30)
    runner = PagedRunner(model)
    seq = runner.new_sequence(tokens)
    got = torch.cat(runner.step([(seq, 25)]) + [runner.step([(seq, 1)])[0] for _ in range(5)])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, hf_logits(path, tokens), atol=0.15, rtol=0.05)


def test_tied_model_shares_embedding(checkpoints: dict[str, Path]) -> None:
    model = load(checkpoints["llama_tied"])
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_unsupported_architecture(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    raw = json.loads((checkpoints["llama"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelConfig.from_pretrained(tmp_path)


def test_missing_weight_file(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes((checkpoints["llama"] / "config.json").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load(tmp_path)


def test_missing_and_unexpected_tensors_are_listed(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    src = checkpoints["llama"]
    (tmp_path / "config.json").write_bytes((src / "config.json").read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match="missing tensors: model.layers.1.self_attn.k_proj.weight"
        r".*unexpected tensors: model.layers.9.mlp.up_proj.weight",
    ):
        load(tmp_path)


def test_shape_mismatch_is_reported(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    src = checkpoints["llama"]
    raw = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"intermediate_size": 64}))
    (tmp_path / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"proj.weight has shape \(64, 96\), the config implies"):
        load(tmp_path)
