"""A Hugging Face tokenizer.json written as GGUF tokenizer metadata: the tokenizer rebuilt
from it (what the engine and llama.cpp read) encodes and renders chats as tokenizer.json
does; splits llama.cpp names are recognized; what cannot be written exactly is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import AddedToken, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from backend_engine.model_loader.gguf_tokenizer_export import (
    pre_tokenizer_name,
    vocabulary_from_hf,
    write_vocabulary,
)
from model_files.gguf_metadata import GGUFError, open_gguf
from model_files.gguf_tokenizer import (
    PRE_TOKENIZER_PATTERNS,
    TokenType,
    read_vocabulary,
    tokenizer_from_gguf,
)
from model_files.tokenizer import Tokenizer
from tests.model_files.gguf_tokenizer_files import (
    AWKWARD_TEXTS,
    CHATML_TEMPLATE,
    CONVERSATIONS,
    train_byte_level_bpe,
)


def write_hf_tokenizer(
    directory: Path,
    backend: HFTokenizer,
    *,
    eos_token_ids: list[int] | None = None,
    bos_token: str | None = "<|im_start|>",
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {
        "bos_token": bos_token,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if eos_token_ids is not None:
        generation = {"eos_token_id": eos_token_ids}
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


def with_bos(backend: HFTokenizer) -> HFTokenizer:
    bos = "<|im_start|>"
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, 1)]
    )
    return backend


def through_gguf(directory: Path, vocab_size: int, path: Path) -> Tokenizer:
    """The tokenizer the engine reads from a GGUF file holding the converted vocabulary."""
    writer = gguf.GGUFWriter(path, "llama")
    write_vocabulary(writer, vocabulary_from_hf(directory, vocab_size))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokenizer_from_gguf(open_gguf(path), str(path))


@pytest.mark.parametrize(
    ("pre", "bos"), [("llama-bpe", True), ("qwen2", False), ("smollm", False), ("gpt-2", True)]
)
def test_the_gguf_tokenizer_encodes_as_tokenizer_json(tmp_path: Path, pre: str, bos: bool) -> None:
    backend = train_byte_level_bpe(pre)
    backend.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    if bos:
        with_bos(backend)
    directory = write_hf_tokenizer(tmp_path / "hf", backend, eos_token_ids=[2])
    expected = Tokenizer.from_pretrained(directory)
    ours = through_gguf(directory, backend.get_vocab_size(), tmp_path / "t.gguf")
    for text in AWKWARD_TEXTS:
        for add_special_tokens in (True, False):
            assert ours.encode(text, add_special_tokens) == expected.encode(
                text, add_special_tokens
            ), text
    for messages in CONVERSATIONS:
        assert ours.encode_chat(messages) == expected.encode_chat(messages)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (
        expected.bos_token_id,
        expected.eos_token_ids,
        expected.pad_token_id,
    )
    vocabulary = read_vocabulary(open_gguf(tmp_path / "t.gguf"))
    assert vocabulary.pre == pre
    assert vocabulary.add_bos_token is bos
    assert vocabulary.token_types[:3] == [TokenType.CONTROL] * 3
    assert vocabulary.tokens[-1] == "<tool>"
    assert vocabulary.token_types[-1] == TokenType.USER_DEFINED  # added, not special
    assert set(vocabulary.token_types[3:-1]) <= {TokenType.NORMAL, TokenType.CONTROL}


def test_smollm2s_own_split_is_named_smollm() -> None:
    """SmolLM2's tokenizer.json splits digits off with a Digits step, then GPT-2's regex."""
    spec = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True},
        ],
    }
    assert pre_tokenizer_name(spec) == "smollm"
    assert pre_tokenizer_name({"type": "ByteLevel", "add_prefix_space": False}) == "gpt-2"
    split = {
        "type": "Split",
        "pattern": {"Regex": PRE_TOKENIZER_PATTERNS["llama3"]},
        "behavior": "Isolated",
        "invert": False,
    }
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}
    assert pre_tokenizer_name({"type": "Sequence", "pretokenizers": [split, byte_level]}) == (
        "llama-bpe"
    )
    with pytest.raises(GGUFError, match=r"not one llama\.cpp names"):
        pre_tokenizer_name({"type": "ByteLevel", "add_prefix_space": True})
    odd = {**split, "pattern": {"Regex": r"\w+"}}
    with pytest.raises(GGUFError, match=r"not one llama\.cpp names"):
        pre_tokenizer_name({"type": "Sequence", "pretokenizers": [odd, byte_level]})


def test_a_larger_model_vocabulary_is_padded_with_unused_tokens(tmp_path: Path) -> None:
    backend = train_byte_level_bpe("smollm", vocab_size=320)
    directory = write_hf_tokenizer(tmp_path / "hf", backend)
    vocabulary = vocabulary_from_hf(directory, backend.get_vocab_size() + 3)
    size = backend.get_vocab_size()
    assert vocabulary.tokens[size:] == [f"[PAD{size}]", f"[PAD{size + 1}]", f"[PAD{size + 2}]"]
    assert vocabulary.token_types[size:] == [TokenType.UNUSED] * 3
    with pytest.raises(GGUFError, match="320 tokens but the model's vocab_size is 319"):
        vocabulary_from_hf(directory, size - 1)


def test_further_stop_ids_become_eot_and_eom(tmp_path: Path) -> None:
    backend = train_byte_level_bpe("smollm", vocab_size=320)
    directory = write_hf_tokenizer(tmp_path / "hf", backend, eos_token_ids=[2, 0, 3])
    vocabulary = vocabulary_from_hf(directory, backend.get_vocab_size())
    assert vocabulary.special_ids == {"bos": 1, "eos": 2, "pad": 0, "eot": 0, "eom": 3}
    too_many = write_hf_tokenizer(tmp_path / "many", backend, eos_token_ids=[0, 1, 2, 3])
    with pytest.raises(GGUFError, match="GGUF holds at most 3"):
        vocabulary_from_hf(too_many, backend.get_vocab_size())


def test_what_cannot_be_written_exactly_is_refused(tmp_path: Path) -> None:
    normalized = train_byte_level_bpe("qwen2", vocab_size=320)
    normalized.normalizer = normalizers.NFC()
    directory = write_hf_tokenizer(tmp_path / "nfc", normalized)
    with pytest.raises(GGUFError, match="NFC normalizer has no GGUF equivalent"):
        vocabulary_from_hf(directory, 320)

    # a post-processor that appends two end tokens: GGUF's add_eos_token adds one
    doubled = train_byte_level_bpe("smollm", vocab_size=320)
    doubled.post_processor = processors.TemplateProcessing(
        single="$A <|im_end|> <|im_end|>", special_tokens=[("<|im_end|>", 2)]
    )
    directory = write_hf_tokenizer(tmp_path / "doubled", doubled)
    with pytest.raises(GGUFError, match="cannot be converted exactly"):
        vocabulary_from_hf(directory, 320)

    metaspace = train_byte_level_bpe("smollm", vocab_size=320)
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    directory = write_hf_tokenizer(tmp_path / "metaspace", metaspace)
    with pytest.raises(GGUFError, match=r"not one llama\.cpp names"):
        vocabulary_from_hf(directory, 320)
