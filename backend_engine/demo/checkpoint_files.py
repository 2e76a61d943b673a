"""Everything in a demo checkpoint but its weights: tokenizer, configs, shapes (torch-free).

A demo checkpoint (``demo_model.write_demo_checkpoint``) is a directory in exact Hugging
Face format, written offline; this module writes all of it but the weights, so the
gateway's tests can count tokens with a demo model's tokenizer where torch is not
installed::

    config.json                      architecture, shapes, rope, bos/eos ids
    generation_config.json           bos_token_id, eos_token_id = [<|eot_id|>, <|end_of_text|>]
    model.safetensors                (or model-0000i-of-0000N.safetensors
                                     + model.safetensors.index.json when sharded)
    tokenizer.json                   byte-level BPE trained on ``demo_corpus``, Llama-3 style
    tokenizer_config.json            special tokens and a Llama-3 chat template

Everything is deterministic: the same ``size``/options give byte-identical files. The
tokenizer depends only on ``size`` (and, for Qwen2, the architecture).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

from backend_engine.demo.corpus import iter_demo_corpus

DEMO_SIZES = ("tiny", "small", "large")
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
DTYPES = ("float32", "bfloat16", "float16")

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


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_demo_model_files(
    path: Path,
    *,
    size: str,
    architecture: str,
    dtype: str,
    tie_word_embeddings: bool,
    rope_scaling: dict[str, Any] | None,
) -> None:
    """Write a demo checkpoint's tokenizer.json, tokenizer_config.json, config.json and
    generation_config.json into ``path`` (an existing directory): all but the weights."""
    check_demo_options(size, architecture, dtype, rope_scaling)
    shape = DEMO_SHAPES[size]
    tok = train_demo_tokenizer(shape.vocab_size, architecture)
    tok.save(str(path / "tokenizer.json"))
    write_json(
        path / "tokenizer_config.json", _tokenizer_config(tok, shape.max_position_embeddings)
    )
    bos_id = _token_id(tok, BOS_TOKEN)
    eos_ids = [_token_id(tok, EOT_TOKEN), _token_id(tok, END_OF_TEXT_TOKEN)]
    config = _model_config(
        shape, architecture, dtype, tie_word_embeddings, rope_scaling, bos_id, eos_ids
    )
    write_json(path / "config.json", config)
    generation_config = {
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "transformers_version": _FORMAT_VERSION,
    }
    write_json(path / "generation_config.json", generation_config)


def check_demo_options(
    size: str, architecture: str, dtype: str, rope_scaling: dict[str, Any] | None
) -> None:
    if size not in DEMO_SHAPES:
        raise ValueError(f"size must be one of {DEMO_SIZES}, got {size!r}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if rope_scaling is not None and not ({"rope_type", "type"} & rope_scaling.keys()):
        raise ValueError(f"rope_scaling needs a 'rope_type' key, got {rope_scaling!r}")
