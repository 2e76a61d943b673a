"""The tokenizer rebuilt from a GGUF file's metadata, against transformers' GGUF tokenizer.

On the shipped SmolLM2 file and on small files written with ``gguf.GGUFWriter`` for each
supported pre-tokenizer, ours must give transformers' ids for every awkward text (with and
without special tokens), decode them back to the text, and render chats the same.

transformers' GGUF loader has no rule for ``tokenizer.ggml.pre = smollm`` and leaves GPT-2's
split, which differs from llama.cpp and from SmolLM2's own ``tokenizer.json`` (digits split off
first) where whitespace precedes a digit. For ``smollm`` the referee is therefore transformers'
GGUF tokenizer with SmolLM2's published pre-tokenizer put back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import pre_tokenizers

from model_files.checkpoint import load_tokenizer
from model_files.gguf_metadata import GGUFError, open_gguf
from model_files.gguf_tokenizer import PRE_TOKENIZER_PATTERNS, tokenizer_from_gguf
from model_files.tokenizer import Tokenizer
from tests.model_files.gguf_tokenizer_files import (
    AWKWARD_TEXTS,
    CONVERSATIONS,
    add_byte_level_tokenizer,
    add_llama_metadata,
    train_byte_level_bpe,
    write_sentencepiece_gguf,
    write_tokenizer_gguf,
)

transformers = pytest.importorskip("transformers")

SYNTHETIC_PRES = ("gpt-2", "smollm", "llama-bpe", "qwen2")


def referee(path: Path, pre: str) -> Any:
    """transformers' tokenizer for the GGUF file (see the module's docstring for smollm)."""
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if pre == "smollm":
        hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return hf


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_gguf: Path) -> tuple[Tokenizer, Any]:
    return load_tokenizer(smollm2_gguf), referee(smollm2_gguf, "smollm")


@pytest.fixture(scope="module", params=["smollm2-file", *SYNTHETIC_PRES, "sentencepiece"])
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Tokenizer, Any]:
    """The shipped file, or a synthetic file per pre-tokenizer."""
    if request.param == "smollm2-file":
        pair: tuple[Tokenizer, Any] = request.getfixturevalue("smollm2_pair")
        return pair
    pre = request.param
    path = tmp_path_factory.mktemp(pre) / f"{pre}.gguf"
    if pre == "sentencepiece":
        write_sentencepiece_gguf(path)
    else:
        unused = 3 if pre == "qwen2" else 0  # llama.cpp's [PAD<id>] fillers
        write_tokenizer_gguf(path, pre, add_bos_token=pre == "llama-bpe", num_unused=unused)
    return load_tokenizer(path), referee(path, pre)


def test_ids_match_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    for text in AWKWARD_TEXTS:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        ), text


def test_decode_gives_the_text_back(pair: tuple[Tokenizer, Any]) -> None:
    """Exactly, except SentencePiece's prefix space: HF adds none before a text that starts
    with a space yet strips one when decoding (transformers' Llama tokenizer does the same)."""
    ours, hf = pair
    is_sentencepiece = getattr(ours.backend.model, "byte_fallback", False)
    for text in AWKWARD_TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        if not (is_sentencepiece and text[:1].isspace()):
            assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_chat_template_matches_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert ours.apply_chat_template(messages, add_generation_prompt) == expected
        assert ours.encode_chat(messages) == hf.encode(
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )


def test_smollm2_special_tokens(smollm2_pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = smollm2_pair
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (1, {2}, 2)
    assert ours.vocab_size == len(hf) == 49_152
    assert ours.encode("Hi") == ours.encode("Hi", add_special_tokens=False)  # add_bos_token off
    control = ours.encode("<|im_start|>user<|endoftext|>", add_special_tokens=False)
    assert control[0] == 1
    assert control[-1] == 0
    assert all(ours.is_special(i) for i in range(17))
    assert not ours.is_special(17)
    assert ours.decode(control) == "user"


def test_smollm_splits_digits_first_as_llama_cpp(tmp_path: Path) -> None:
    """llama.cpp's smollm rule: each digit alone, then GPT-2's regex on the pieces between,
    so a whitespace run before a digit stays one piece."""
    path = write_tokenizer_gguf(tmp_path / "s.gguf", "smollm")
    backend = tokenizer_from_gguf(open_gguf(path), str(path)).backend
    assert backend.pre_tokenizer is not None
    pieces = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("  12 ab3  x")]
    assert pieces == ["ĠĠ", "1", "2", "Ġab", "3", "Ġ", "Ġx"]


def test_user_defined_tokens_stay_whole_but_are_not_special(tmp_path: Path) -> None:
    path = write_tokenizer_gguf(tmp_path / "u.gguf", "qwen2")
    ours = load_tokenizer(path)
    think = ours.backend.token_to_id("<think>")
    ids = ours.encode("a<think>b", add_special_tokens=False)
    assert think in ids
    assert not ours.is_special(think)
    assert ours.decode(ids) == "a<think>b"


@pytest.mark.parametrize(
    ("pre", "flag", "adds_bos"),
    [("llama-bpe", None, True), ("gpt-2", None, False), ("gpt-2", True, True)],
)
def test_add_bos_token_follows_the_file_then_llama_cpp(
    tmp_path: Path, pre: str, flag: bool | None, adds_bos: bool
) -> None:
    """``tokenizer.ggml.add_bos_token`` decides; without it llama.cpp adds BOS for Llama-3."""
    path = write_tokenizer_gguf(tmp_path / "b.gguf", pre, add_bos_token=flag)
    ours = load_tokenizer(path)
    ids = ours.encode("hello")
    assert (ids[0] == ours.bos_token_id) is adds_bos
    assert len(ids) == len(ours.encode("hello", add_special_tokens=False)) + adds_bos


@pytest.mark.parametrize("add_space_prefix", [None, True, False])
def test_sentencepiece_space_prefix_and_byte_fallback(
    tmp_path: Path, add_space_prefix: bool | None
) -> None:
    """BOS by default, a "▁" before the text unless add_space_prefix is false, and a character
    the vocabulary lacks as its UTF-8 byte tokens."""
    path = write_sentencepiece_gguf(tmp_path / "spm.gguf", add_space_prefix=add_space_prefix)
    ours = load_tokenizer(path)
    ids = ours.encode("def 𝄞")
    assert ids[0] == ours.bos_token_id == 1
    pieces = ours.convert_ids_to_tokens(ids[1:])
    assert pieces[0].startswith("▁") is (add_space_prefix is not False)
    assert pieces[-4:] == ["<0xF0>", "<0x9D>", "<0x84>", "<0x9E>"]  # U+1D11E
    assert ours.decode(ids) == "def 𝄞"


def write_with(path: Path, pre: str, **overrides: Any) -> Path:
    """A tokenizer file whose metadata ``overrides`` replace (None removes a key)."""
    writer = gguf.GGUFWriter(path, "llama")
    backend = train_byte_level_bpe("gpt-2", vocab_size=300)
    add_llama_metadata(writer, backend.get_vocab_size())
    add_byte_level_tokenizer(writer, backend, pre)
    for key, value in overrides.items():
        del writer.kv_data[0][key]
        if value is not None:
            writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unknown_pre_tokenizer_is_named_with_the_supported_ones(tmp_path: Path) -> None:
    path = write_with(tmp_path / "p.gguf", "chameleon-9")
    with pytest.raises(GGUFError, match="unknown GGUF pre-tokenizer 'chameleon-9'") as error:
        load_tokenizer(path)
    assert all(name in str(error.value) for name in PRE_TOKENIZER_PATTERNS)


def test_a_byte_level_file_without_a_pre_tokenizer_says_so(tmp_path: Path) -> None:
    path = write_with(tmp_path / "p.gguf", "gpt-2", **{"tokenizer.ggml.pre": None})
    with pytest.raises(GGUFError, match="names no pre-tokenizer"):
        load_tokenizer(path)


def test_an_unsupported_tokenizer_model_is_named(tmp_path: Path) -> None:
    path = write_with(tmp_path / "m.gguf", "gpt-2", **{"tokenizer.ggml.model": "bert"})
    with pytest.raises(GGUFError, match="unsupported GGUF tokenizer model 'bert'"):
        load_tokenizer(path)


def test_byte_level_bpe_without_merges_is_refused(tmp_path: Path) -> None:
    path = write_with(tmp_path / "n.gguf", "gpt-2", **{"tokenizer.ggml.merges": None})
    with pytest.raises(GGUFError, match=r"no tokenizer\.ggml\.merges"):
        load_tokenizer(path)


def test_a_file_without_a_chat_template_says_so(tmp_path: Path) -> None:
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "gpt-2", chat_template=None)
    with pytest.raises(ValueError, match=r"t\.gguf has no tokenizer\.chat_template"):
        load_tokenizer(path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="no GGUF file at"):
        load_tokenizer(tmp_path / "absent.gguf")
