"""A byte-level BPE ``tokenizer.json`` converted to tiktoken's form, or refused with the reason.

tiktoken counts about 7x faster than ``tokenizers`` here, and reproduces a byte-level BPE
exactly when its pieces are the same: one regex split (a ``Split`` + ``ByteLevel`` or a plain
``ByteLevel`` pre-tokenizer, no prefix space), NFC or no normalization, merges that rebuild
every token they make, ranks in merge order. :func:`tiktoken_vocabulary` checks each of those
and raises :class:`UnsupportedTokenizer` naming the first that does not hold; the gateway then
counts with the engine's own tokenizer (``token_counter.exact_counter``).

A vocabulary may lack some single-byte tokens (SmolLM2's lacks 21); Hugging Face drops such a
byte and merges its neighbours across the gap, which tiktoken cannot do, so
``TiktokenVocabulary.unencodable`` is the pattern of characters that need the exact tokenizer.
"""

from __future__ import annotations

import functools
import itertools
import sys
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tokenizers import models


class UnsupportedTokenizer(ValueError):
    """The checkpoint's tokenizer cannot be reproduced exactly by tiktoken."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character standing for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return {c: b for b, c in chars.items()}


# HF's ByteLevel(use_regex=True) pre-tokenizer pattern (GPT-2's).
_BYTE_LEVEL_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _steps(spec: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """The steps of a (possibly ``Sequence``) normalizer or pre-tokenizer."""
    if spec is None:
        return []
    return list(spec.get(key, [])) if spec.get("type") == "Sequence" else [spec]


def _pattern(pre_tokenizer: dict[str, Any] | None) -> str:
    """The regex tiktoken splits with, from a Split + ByteLevel (or a lone ByteLevel) chain."""
    steps = _steps(pre_tokenizer, "pretokenizers")
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        byte_level, pattern = steps[0], _BYTE_LEVEL_PATTERN
    elif kinds == ["Split", "ByteLevel"]:
        split, byte_level = steps
        regex = split.get("pattern", {}).get("Regex")
        if not isinstance(regex, str):
            raise UnsupportedTokenizer("the Split pre-tokenizer splits on a string, not a regex")
        if split.get("behavior") != "Isolated" or split.get("invert"):
            raise UnsupportedTokenizer("the Split pre-tokenizer is not Isolated/non-inverted")
        if byte_level.get("use_regex", True):
            raise UnsupportedTokenizer("ByteLevel after Split applies a second regex")
        pattern = regex
    else:
        raise UnsupportedTokenizer(f"pre-tokenizer {kinds} is not Split+ByteLevel or ByteLevel")
    if byte_level.get("add_prefix_space"):
        raise UnsupportedTokenizer("the ByteLevel pre-tokenizer adds a prefix space")
    return pattern


def _normalizer(spec: dict[str, Any] | None) -> Callable[[str], str] | None:
    kinds = [step.get("type") for step in _steps(spec, "normalizers")]
    if not kinds:
        return None
    if kinds == ["NFC"]:
        return functools.partial(unicodedata.normalize, "NFC")
    raise UnsupportedTokenizer(f"normalizer {kinds} is not NFC")


@dataclass(frozen=True)
class TiktokenVocabulary:
    """A ``tokenizer.json`` as tiktoken sees it.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank and returns ranks
    as token ids; HF's BPE merges only the pairs its merges list names, in list order. So:

    - ranks follow merges order. They are the vocabulary ids when each merge makes a larger id
      than the merges before it (as ``tokenizers``' trainer assigns them); otherwise they are
      positions (bytes, merges, then added tokens) and ``rank_to_id`` maps them back to ids.
    - tiktoken may also merge a pair x|y the list does not name, when x+y is a token; and it
      takes a pre-tokenized piece that is itself a token whole, as HF does only with
      ``ignore_merges``. Neither can change a result if the merges alone rebuild every token
      from its bytes (checked at conversion): the first unnamed pair x|y tiktoken met would
      also be reached by HF's merges on the bytes of x+y alone, which would then stop at x|y.
    """

    mergeable_ranks: dict[bytes, int]
    special_tokens: dict[str, int]
    pat_str: str
    rank_to_id: tuple[int, ...] | None
    normalize: Callable[[str], str] | None
    # The characters with a byte the vocabulary has no token for (a regex class), or None.
    unencodable: str | None = None


def _merge_pairs(merges: list[Any]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        pairs.append((left, right))
    return pairs


def _check_merges_rebuild_tokens(
    vocab: dict[str, int], pairs: list[tuple[str, str]], tokens: Iterable[str]
) -> None:
    merges_only = models.BPE(vocab, pairs, ignore_merges=False)
    for token in tokens:
        pieces = [piece.value for piece in merges_only.tokenize(token)]
        if pieces != [token]:
            raise UnsupportedTokenizer(f"the merges split the token {token!r} into {pieces}")


def tiktoken_vocabulary(spec: dict[str, Any]) -> TiktokenVocabulary:
    """Convert a parsed ``tokenizer.json``; ``UnsupportedTokenizer`` says why it cannot be."""
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise UnsupportedTokenizer(f"the model is {model.get('type')}, not BPE")
    for option in ("byte_fallback", "dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(option):
            raise UnsupportedTokenizer(f"the BPE model sets {option}={model[option]!r}")
    pat_str = _pattern(spec.get("pre_tokenizer"))
    normalize = _normalizer(spec.get("normalizer"))

    byte_of = _byte_decoder()
    vocab: dict[str, int] = model["vocab"]
    added = {t["content"]: t for t in spec.get("added_tokens", [])}
    added_ids = {t["id"] for t in added.values()}
    for content, token in added.items():
        flags = [f for f in ("lstrip", "rstrip", "single_word") if token.get(f)]
        if flags:
            raise UnsupportedTokenizer(f"added token {content!r} sets {', '.join(flags)}")
        if normalize and token.get("normalized") and normalize(content) != content:
            raise UnsupportedTokenizer(f"added token {content!r} changes under normalization")

    def to_bytes(token: str) -> bytes:
        try:
            return bytes(byte_of[c] for c in token)
        except KeyError:
            raise UnsupportedTokenizer(f"token {token!r} is not byte-level") from None

    byte_ids = [vocab.get(c) for c in byte_of]
    unencodable = _unencodable_chars([byte_of[c] for c in byte_of if c not in vocab])
    merged_ids = []
    pairs = _merge_pairs(model.get("merges", []))
    for left, right in pairs:
        merged_id = vocab.get(left + right)
        if merged_id is None:
            raise UnsupportedTokenizer(f"merge {left!r} {right!r} makes no vocabulary token")
        merged_ids.append(merged_id)
    if len(set(merged_ids)) != len(merged_ids):
        raise UnsupportedTokenizer("some token is made by two different merges")
    # A token no merge makes (llama.cpp's [PAD123] fillers) is never produced by HF's merges,
    # and tiktoken never sees it: it gets no rank. With ignore_merges HF would still take a
    # piece that is one whole, so there it cannot be left out.
    unreachable = set(vocab.values()) - set(merged_ids) - set(byte_ids) - added_ids
    if unreachable and model.get("ignore_merges"):
        raise UnsupportedTokenizer(
            f"{len(unreachable)} tokens are not made by any merge, and ignore_merges is set"
        )

    token_of = {token_id: token for token, token_id in vocab.items()}
    bpe_ids = [i for i in byte_ids if i is not None] + merged_ids
    _check_merges_rebuild_tokens(vocab, pairs, (token_of[i] for i in merged_ids))
    if all(a < b for a, b in itertools.pairwise(merged_ids)):
        ranks = {to_bytes(token_of[i]): i for i in bpe_ids}
        specials = {content: token["id"] for content, token in added.items()}
        return TiktokenVocabulary(ranks, specials, pat_str, None, normalize, unencodable)
    ranks = {to_bytes(token_of[i]): rank for rank, i in enumerate(bpe_ids)}
    specials = {content: len(bpe_ids) + n for n, content in enumerate(added)}
    rank_to_id = (*bpe_ids, *(token["id"] for token in added.values()))
    return TiktokenVocabulary(ranks, specials, pat_str, rank_to_id, normalize, unencodable)


def _unencodable_chars(missing_bytes: Iterable[int]) -> str | None:
    """A regex class of the characters whose UTF-8 holds one of ``missing_bytes``.

    HF's byte-level BPE (without ``unk_token``) drops such a byte and merges its neighbours
    across the gap, which tiktoken cannot do: texts holding one are encoded by HF instead.
    SmolLM2 lacks 21 bytes: 6 control characters, the lead bytes of planes 4 to 11 and bytes
    UTF-8 never uses. A missing continuation byte would touch most characters: refused.
    """
    ranges = []
    for byte in sorted(missing_bytes):
        if byte < 0x80:
            first, size = byte, 1
        elif byte < 0xC0:
            raise UnsupportedTokenizer(f"the vocabulary lacks the token of byte {byte:#x}")
        elif 0xC2 <= byte <= 0xDF:
            first, size = (byte & 0x1F) << 6, 1 << 6
        elif 0xE0 <= byte <= 0xEF:
            first, size = (byte & 0x0F) << 12, 1 << 12
        elif 0xF0 <= byte <= 0xF4:
            first, size = (byte & 0x07) << 18, 1 << 18
        else:
            continue  # 0xC0, 0xC1, 0xF5-0xFF: not in any UTF-8 text
        last = min(first + size - 1, sys.maxunicode)
        ranges.append(f"\\U{first:08x}-\\U{last:08x}")
    return f"[{''.join(ranges)}]" if ranges else None
