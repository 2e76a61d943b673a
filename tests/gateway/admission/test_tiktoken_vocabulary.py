"""tiktoken_vocabulary: what tiktoken cannot reproduce exactly is refused, with the reason.

(That what it converts counts exactly as the engine's tokenizer is tested through the counters
in test_token_counter.py.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.admission.tiktoken_vocabulary import UnsupportedTokenizer, tiktoken_vocabulary

# --- what tiktoken cannot represent --------------------------------------------------------------


def _break_model_type(spec: dict[str, Any]) -> None:
    spec["model"]["type"] = "Unigram"


def _break_byte_fallback(spec: dict[str, Any]) -> None:
    spec["model"]["byte_fallback"] = True


def _break_pre_tokenizer(spec: dict[str, Any]) -> None:
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}


def _break_split_string(spec: dict[str, Any]) -> None:
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"String": " "}


def _break_normalizer(spec: dict[str, Any]) -> None:
    spec["normalizer"] = {"type": "Lowercase"}


def _break_added_token(spec: dict[str, Any]) -> None:
    spec["added_tokens"][0]["lstrip"] = True


def _break_byte_alphabet(spec: dict[str, Any]) -> None:
    del spec["model"]["vocab"]["Ģ"]  # the token for byte 0x80, in most multi-byte characters


def _break_unreachable_token(spec: dict[str, Any]) -> None:
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    spec["model"]["ignore_merges"] = True


@pytest.mark.parametrize(
    ("breaker", "reason"),
    [
        (_break_model_type, "the model is Unigram, not BPE"),
        (_break_byte_fallback, "sets byte_fallback"),
        (_break_pre_tokenizer, r"pre-tokenizer \['Metaspace'\]"),
        (_break_split_string, "splits on a string"),
        (_break_normalizer, r"normalizer \['Lowercase'\] is not NFC"),
        (_break_added_token, "sets lstrip"),
        (_break_byte_alphabet, "lacks the token of byte 0x80"),
        (_break_unreachable_token, "1 tokens are not made by any merge, and ignore_merges"),
    ],
)
def test_unrepresentable_tokenizers_say_why(
    demo_model_files: Callable[..., Path],
    breaker: Callable[[dict[str, Any]], None],
    reason: str,
) -> None:
    path = demo_model_files(architecture="LlamaForCausalLM", size="tiny")
    spec = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    breaker(spec)
    with pytest.raises(UnsupportedTokenizer, match=reason):
        tiktoken_vocabulary(spec)
    assert issubclass(UnsupportedTokenizer, ValueError)
