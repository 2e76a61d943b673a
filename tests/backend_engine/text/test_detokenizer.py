from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from backend_engine.text.detokenizer import IncrementalDetokenizer
from model_files.tokenizer import Tokenizer

MULTIBYTE_TEXT = "Emoji 🙂🚀👍🏽 and 中文字符, 日本語テキスト, Привет, crème brûlée! 👨‍👩‍👧"


@pytest.fixture(scope="module")
def tokenizer(demo_checkpoint: Callable[..., Path]) -> Tokenizer:
    return Tokenizer.from_pretrained(demo_checkpoint())


def stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    return [detok.add(token_id) for token_id in token_ids]


def test_bpe_splits_characters_but_deltas_never_do(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    # The test is only meaningful if some token carries part of a character.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say something:"))
    deltas = stream(detok, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # something was held back at least once
    assert "".join(deltas) == tokenizer.decode(ids) == MULTIBYTE_TEXT
    assert detok.text == MULTIBYTE_TEXT
    assert detok.output_token_ids == ids
    assert detok.flush() == ""


def test_empty_prompt(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("héllo 🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    assert "".join(stream(detok, ids)) == "héllo 🙂"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    eot = tokenizer.backend.token_to_id("<|eot_id|>")
    ids = [*tokenizer.encode("Hi 中", add_special_tokens=False), eot]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens)
    deltas = stream(detok, ids)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected
    assert expected.endswith("<|eot_id|>") != skip_special_tokens


def test_random_ids_concatenate_to_full_decode(tokenizer: Tokenizer) -> None:
    """A random model emits arbitrary ids, including stray UTF-8 continuation bytes."""
    rng = random.Random(0)
    prompt = tokenizer.encode("prompt 🙂")
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        deltas = stream(detok, ids)
        tail = detok.flush()
        assert "".join(deltas) + tail == tokenizer.decode(ids)
        assert not any(d.endswith("\ufffd") for d in deltas)


def test_flush_releases_an_incomplete_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a🙂", add_special_tokens=False)
    partial = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, [])
    emitted = "".join(stream(detok, ids[:partial]))
    assert not emitted.endswith("\ufffd")
    assert emitted + detok.flush() == tokenizer.decode(ids[:partial])


def test_decodes_a_small_window(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    window_sizes: list[int] = []
    original = Tokenizer.decode

    def spy(self: Tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        window_sizes.append(len(token_ids))
        return original(self, token_ids, skip_special_tokens)

    text = "The quick brown fox jumps over the lazy dog. " * 40
    ids = tokenizer.encode(text, add_special_tokens=False)
    monkeypatch.setattr(Tokenizer, "decode", spy)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x" * 300))
    deltas = stream(detok, ids)
    monkeypatch.undo()
    assert "".join(deltas) == text
    assert len(ids) > 200
    assert max(window_sizes) <= 8
