"""How one token id is shown in logprobs: its text and its exact bytes.

A byte-level BPE token can hold part of a UTF-8 character, so its text alone
(``"\ufffd"``) loses information; OpenAI's ``bytes`` field carries the real bytes,
recovered here from the vocabulary string through GPT-2's byte-to-unicode table.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Protocol

_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback tokens


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]: ...


def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: printable bytes map to themselves,
    the rest to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


class TokenText:
    """Memoised ``(text, bytes)`` per token id for one tokenizer."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_table = _unicode_to_byte()
        space = tokenizer.convert_ids_to_tokens(tokenizer.encode(" ", add_special_tokens=False))
        self._is_byte_level = space == ["\u0120"]  # "Ġ", GPT-2's stand-in for the space byte

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._look_up(token_id)
        return cached

    def _look_up(self, token_id: int) -> tuple[str, list[int]]:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        [raw] = self._tokenizer.convert_ids_to_tokens([token_id])
        if self._is_byte_level and all(c in self._byte_table for c in raw):
            return text, [self._byte_table[c] for c in raw]
        if match := _HEX_BYTE.fullmatch(raw):
            return text, [int(match.group(1), 16)]
        return text, list(text.encode("utf-8"))
