"""``tollway convert SRC.gguf OUT_DIR``: a GGUF file as an exact Hugging Face directory.

What it writes, each from the file (so transformers, vLLM or our own loader can read it):

    config.json              hf_config(): the metadata as transformers names it
    model.safetensors        every tensor dequantized (float32 unless asked otherwise),
                             q/k rows unpermuted, under Hugging Face names
    tokenizer.json           the tokenizer gguf_tokenizer rebuilds from the metadata
    tokenizer_config.json    special tokens, add_bos/add_eos, chat template, model_max_length
    generation_config.json   bos and eos ids (eos, eot and eom all end a generation)

Everything is read and checked before the first file is written, so a file the engine cannot
serve leaves no half-written directory behind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer

from backend_engine.model_loader.gguf_weights import iter_gguf_weights
from model_files.gguf_metadata import GGUFError, hf_config, open_gguf
from model_files.gguf_tokenizer import GGUFVocabulary, build_backend, read_vocabulary
from model_files.tokenizer import (
    GENERATION_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OUTPUT_FILES = (
    CONFIG_FILE,
    WEIGHTS_FILE,
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    GENERATION_CONFIG_FILE,
)


def convert_gguf(
    source: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    show_progress: bool = False,
) -> Path:
    """Write ``source``'s Hugging Face directory to ``out_dir``; returns ``out_dir``.

    Raises ``GGUFError`` for a file that cannot be converted and ``ValueError`` for a bad
    ``dtype`` or an ``out_dir`` that is a file or holds files (unless ``overwrite``).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    target = Path(out_dir)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ValueError(f"{target} is not empty (--force writes into it anyway)")
    reader = open_gguf(source)
    config = hf_config(reader)
    vocabulary = read_vocabulary(reader)
    backend = build_backend(vocabulary)
    if backend.get_vocab_size(with_added_tokens=True) != config["vocab_size"]:
        raise GGUFError(
            f"the tokenizer has {backend.get_vocab_size(with_added_tokens=True)} tokens but "
            f"the model's vocab_size is {config['vocab_size']}"
        )
    weights = dict(iter_gguf_weights(reader, DTYPES[dtype], show_progress=show_progress))
    eos_ids = _eos_ids(vocabulary)
    config.update(torch_dtype=dtype, eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids)
    if "pad" in vocabulary.special_ids:
        config["pad_token_id"] = vocabulary.special_ids["pad"]

    target.mkdir(parents=True, exist_ok=True)
    _write_json(target / CONFIG_FILE, dict(sorted(config.items())))
    save_file(weights, str(target / WEIGHTS_FILE), metadata={"format": "pt"})
    # safetensors creates the file private (0600); give it the mode the other files got.
    (target / WEIGHTS_FILE).chmod((target / CONFIG_FILE).stat().st_mode & 0o777)
    backend.save(str(target / TOKENIZER_FILE))
    _write_json(
        target / TOKENIZER_CONFIG_FILE,
        tokenizer_config(vocabulary, backend, config["max_position_embeddings"]),
    )
    _write_json(target / GENERATION_CONFIG_FILE, generation_config(vocabulary))
    return target


def tokenizer_config(
    vocabulary: GGUFVocabulary, backend: HFTokenizer, model_max_length: int
) -> dict[str, Any]:
    """``tokenizer_config.json``: the added tokens, named special tokens and chat template."""
    added = {
        str(token_id): {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
        for token_id, token in sorted(backend.get_added_tokens_decoder().items())
    }
    config: dict[str, Any] = {
        "added_tokens_decoder": added,
        "add_bos_token": vocabulary.add_bos_token,
        "add_eos_token": vocabulary.add_eos_token,
        "bos_token": vocabulary.token("bos"),
        "clean_up_tokenization_spaces": False,
        "eos_token": vocabulary.token("eos"),
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "pad_token": vocabulary.token("pad"),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": vocabulary.token("unk"),
    }
    if vocabulary.chat_template is not None:
        config["chat_template"] = vocabulary.chat_template
    return config


def generation_config(vocabulary: GGUFVocabulary) -> dict[str, Any]:
    config: dict[str, Any] = {}
    if "bos" in vocabulary.special_ids:
        config["bos_token_id"] = vocabulary.special_ids["bos"]
    eos_ids = _eos_ids(vocabulary)
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if "pad" in vocabulary.special_ids:
        config["pad_token_id"] = vocabulary.special_ids["pad"]
    return config


def _eos_ids(vocabulary: GGUFVocabulary) -> list[int]:
    ids = [vocabulary.special_ids.get(role) for role in ("eos", "eot", "eom")]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
