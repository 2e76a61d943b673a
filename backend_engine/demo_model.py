"""Random-weight demo checkpoints in exact Hugging Face format, written offline.

A checkpoint directory holds what ``transformers`` itself would load::

    config.json                      architecture, shapes, rope, bos/eos ids
    generation_config.json           bos_token_id, eos_token_id = [<|eot_id|>, <|end_of_text|>]
    model.safetensors                (or model-0000i-of-0000N.safetensors
                                     + model.safetensors.index.json when sharded)
    tokenizer.json                   byte-level BPE trained on ``demo_corpus``, Llama-3 style
    tokenizer_config.json            special tokens and a Llama-3 chat template

Everything is deterministic: the same ``size``/``seed``/options give byte-identical files.
The tokenizer depends only on ``size``; the weights on ``size``, ``seed`` and the options.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress
from safetensors.torch import save_file
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as HFTokenizer

from backend_engine.demo_corpus import iter_demo_corpus

DEMO_SIZES = ("tiny", "small", "large")
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The cl100k / Llama-3 pre-tokenization regex (what tiktoken uses).
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 splits digits one by one and NFC-normalizes; transformers' Qwen2Tokenizer rebuilds its
# pre-tokenizer with this pattern whatever tokenizer.json says, so Qwen2 demos use it too.
QWEN2_PRETOKENIZE_PATTERN = PRETOKENIZE_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
PAD_TOKEN = "<|finetune_right_pad_id|>"
# Appended after the BPE vocabulary, in this order (as Llama 3 does at id 128000+).
SPECIAL_TOKENS = (
    BOS_TOKEN,
    END_OF_TEXT_TOKEN,
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    PAD_TOKEN,
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOT_TOKEN,
)
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
_CORPUS_CHARS = 200_000
_FORMAT_VERSION = "4.46.0"  # the transformers config format these files follow


@dataclass(frozen=True)
class DemoShape:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


DEMO_SHAPES = {
    "tiny": DemoShape(512, 64, 2, 4, 2, 128, 2048, 10000.0),
    "small": DemoShape(4096, 256, 4, 8, 4, 768, 4096, 10000.0),
    "large": DemoShape(8192, 512, 8, 8, 2, 768, 4096, 500000.0),
}


def train_demo_tokenizer(vocab_size: int, architecture: str = "LlamaForCausalLM") -> HFTokenizer:
    """Train the byte-level BPE; special tokens take the last ``len(SPECIAL_TOKENS)`` ids."""
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must exceed 256 bytes + special tokens, got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    pattern = PRETOKENIZE_PATTERN
    if architecture == "Qwen2ForCausalLM":
        pattern = QWEN2_PRETOKENIZE_PATTERN
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_demo_corpus(_CORPUS_CHARS), trainer)
    specials = list(SPECIAL_TOKENS)
    num_padding = vocab_size - tok.get_vocab_size() - len(specials)
    specials += [f"<|reserved_special_token_{i + 2}|>" for i in range(num_padding)]
    tok.add_special_tokens(
        [
            AddedToken(s, special=True, normalized=False, lstrip=False, rstrip=False)
            for s in specials
        ]
    )
    bos_id = _token_id(tok, BOS_TOKEN)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def _token_id(tok: HFTokenizer, token: str) -> int:
    token_id = tok.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"{token} is missing from the demo vocabulary")
    return int(token_id)


def _tokenizer_config(tok: HFTokenizer, model_max_length: int) -> dict[str, Any]:
    added = {
        str(token_id): {
            "content": token.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token_id, token in sorted(tok.get_added_tokens_decoder().items())
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOT_TOKEN,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _model_config(
    shape: DemoShape,
    architecture: str,
    dtype: str,
    tie_word_embeddings: bool,
    rope_scaling: dict[str, Any] | None,
    bos_token_id: int,
    eos_token_ids: list[int],
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [architecture],
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_ids,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "num_attention_heads": shape.num_attention_heads,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_key_value_heads": shape.num_key_value_heads,
        "rms_norm_eps": 1e-5,
        "rope_scaling": rope_scaling,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
        "transformers_version": _FORMAT_VERSION,
        "use_cache": True,
        "vocab_size": shape.vocab_size,
    }
    if architecture == "LlamaForCausalLM":
        config.update(model_type="llama", attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif architecture == "Qwen2ForCausalLM":
        config.update(
            model_type="qwen2",
            attention_bias=True,  # not read by transformers (q/k/v biases are always on)
            max_window_layers=shape.num_hidden_layers,
            rms_norm_eps=1e-6,
            sliding_window=None,
            use_sliding_window=False,
        )
    else:
        config.update(model_type="mistral", sliding_window=None)
    return dict(sorted(config.items()))


def _init_weights(
    shape: DemoShape, architecture: str, tie_word_embeddings: bool, seed: int
) -> dict[str, torch.Tensor]:
    """Random weights, scaled so that every layer matters and logits are well spread.

    Linear layers get std 1/sqrt(fan_in) (outputs of order one, so attention shapes the result),
    the embedding std 1 and the lm_head std 2/sqrt(hidden): the final RMSNorm makes logits
    roughly N(0, 2^2), so top-1/top-2 gaps are rarely below float noise.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden, head_dim = shape.hidden_size, shape.head_dim
    q_dim = shape.num_attention_heads * head_dim
    kv_dim = shape.num_key_value_heads * head_dim

    def normal(*size: int, std: float) -> torch.Tensor:
        return torch.randn(*size, generator=gen) * std

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        # [out_features, in_features], the nn.Linear layout
        return normal(out_features, in_features, std=1.0 / math.sqrt(in_features))

    embed_std = 2.0 / math.sqrt(hidden) if tie_word_embeddings else 1.0
    weights = {"model.embed_tokens.weight": normal(shape.vocab_size, hidden, std=embed_std)}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.ones(hidden)
        weights[p + "self_attn.q_proj.weight"] = linear(q_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_dim, hidden)
        if architecture == "Qwen2ForCausalLM":
            weights[p + "self_attn.q_proj.bias"] = normal(q_dim, std=0.1)
            weights[p + "self_attn.k_proj.bias"] = normal(kv_dim, std=0.1)
            weights[p + "self_attn.v_proj.bias"] = normal(kv_dim, std=0.1)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, q_dim)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        weights[p + "mlp.gate_proj.weight"] = linear(shape.intermediate_size, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(shape.intermediate_size, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, shape.intermediate_size)
    weights["model.norm.weight"] = torch.ones(hidden)
    if not tie_word_embeddings:
        weights["lm_head.weight"] = normal(shape.vocab_size, hidden, std=2.0 / math.sqrt(hidden))
    return weights


def _write_weights(path: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    names = list(weights)
    if not 1 <= num_shards <= len(names):
        raise ValueError(f"num_shards must be between 1 and {len(names)}, got {num_shards}")
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(weights, str(path / "model.safetensors"), metadata=metadata)
        return
    sizes = [weights[n].numel() * weights[n].element_size() for n in names]
    total_size = sum(sizes)
    # Contiguous groups of about total_size / num_shards bytes each, none empty.
    groups: list[list[str]] = []
    start, written = 0, 0
    for k in range(num_shards):
        end_limit = len(names) - (num_shards - k - 1)
        target = total_size * (k + 1) / num_shards
        end = start + 1
        written += sizes[start]
        while end < end_limit and written < target:
            written += sizes[end]
            end += 1
        groups.append(names[start:end])
        start = end
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups):
        filename = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: weights[n] for n in group}, str(path / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(group, filename))
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(path / "model.safetensors.index.json", index)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_demo_checkpoint(
    path: str | Path,
    *,
    size: str = "small",
    seed: int = 0,
    architecture: str = "LlamaForCausalLM",
    dtype: str = "float32",
    tie_word_embeddings: bool | None = None,
    rope_scaling: dict[str, Any] | None = None,
    num_shards: int = 1,
    show_progress: bool = False,
) -> Path:
    """Write a random-weight checkpoint for ``architecture`` into ``path`` and return it."""
    if size not in DEMO_SHAPES:
        raise ValueError(f"size must be one of {DEMO_SIZES}, got {size!r}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
    if rope_scaling is not None and not ({"rope_type", "type"} & rope_scaling.keys()):
        raise ValueError(f"rope_scaling needs a 'rope_type' key, got {rope_scaling!r}")
    shape = DEMO_SHAPES[size]
    tied = bool(tie_word_embeddings)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    with Progress(disable=not show_progress, transient=True) as progress:
        task = progress.add_task(f"demo checkpoint ({size}, {architecture})", total=4)
        progress.update(task, description="training tokenizer")
        tok = train_demo_tokenizer(shape.vocab_size, architecture)
        tok.save(str(out / "tokenizer.json"))
        _write_json(
            out / "tokenizer_config.json", _tokenizer_config(tok, shape.max_position_embeddings)
        )
        progress.advance(task)

        bos_id = _token_id(tok, BOS_TOKEN)
        eos_ids = [_token_id(tok, EOT_TOKEN), _token_id(tok, END_OF_TEXT_TOKEN)]
        config = _model_config(shape, architecture, dtype, tied, rope_scaling, bos_id, eos_ids)
        _write_json(out / "config.json", config)
        generation_config = {
            "bos_token_id": bos_id,
            "eos_token_id": eos_ids,
            "transformers_version": _FORMAT_VERSION,
        }
        _write_json(out / "generation_config.json", generation_config)
        progress.advance(task)

        progress.update(task, description="initializing weights")
        weights = _init_weights(shape, architecture, tied, seed)
        weights = {name: t.to(_DTYPES[dtype]).contiguous() for name, t in weights.items()}
        progress.advance(task)

        progress.update(task, description="writing safetensors")
        _write_weights(out, weights, num_shards)
        progress.advance(task)
    return out
