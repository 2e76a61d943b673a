"""The tokenizer a GGUF file describes, built from its metadata as a ``Tokenizer``.

A GGUF has no ``tokenizer.json``: llama.cpp stores the vocabulary (``tokenizer.ggml.tokens``),
the merges, each token's type and the special token ids as metadata. This module rebuilds the
same tokenizer with the ``tokenizers`` library, so the engine encodes, decodes and renders chats
exactly as for a Hugging Face directory. Torch-free: the gateway counts prompts with it.

``tokenizer.ggml.model``:

- ``gpt2``: byte-level BPE from tokens plus merges. How text is split before the merges is
  chosen by ``tokenizer.ggml.pre``; llama.cpp's ``llm_tokenizer_bpe`` regexes are the
  specification (``PRE_TOKENIZER_PATTERNS``). Where llama.cpp applies two regexes one after the
  other (digits first, then GPT-2's), one equivalent regex is used, so that the split stays a
  single ``Split`` (which the gateway's tiktoken counter can reproduce).
- ``llama``: SentencePiece-style BPE over ``▁``-spelled pieces, with byte fallback
  (``<0x0A>``); merges come from the file or, when absent, from the scores.

Token types (llama.cpp's ``LLAMA_TOKEN_TYPE_*``) decide the added tokens: ``CONTROL`` and
``UNKNOWN`` ones are special (kept whole, dropped by ``decode(skip_special_tokens=True)``),
``USER_DEFINED`` ones are kept whole but are not special. ``add_bos_token``/``add_eos_token``
become the post-processor; eos, eot and eom ids all end a generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.processors import TemplateProcessing

from model_files.gguf_metadata import GGUFError, metadata_string, metadata_value
from model_files.tokenizer import Tokenizer

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama.cpp splits each digit off first, then applies GPT-2's regex to the pieces between. As one
# regex: a digit is its own piece, and a whitespace run may end where a digit starts (the end of
# its piece) as well as before more whitespace or the end of the text.
_DIGITS_THEN_GPT2 = (
    r"\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> the regex splitting text before BPE (llama.cpp's names and groups).
PRE_TOKENIZER_PATTERNS = {
    "gpt-2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "falcon3": _LLAMA3,
    "pixtral": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}
# llama.cpp takes a pre-tokenized piece that is itself a token whole, without merging, for these
# (its ``ignore_merges``), and adds a BOS when the file does not say.
_LLAMA3_FAMILY = frozenset(name for name, p in PRE_TOKENIZER_PATTERNS.items() if p == _LLAMA3)


class TokenType(IntEnum):
    """llama.cpp's ``llama_token_type``, as stored in ``tokenizer.ggml.token_type``."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass(frozen=True)
class GGUFVocabulary:
    """The tokenizer part of a GGUF file's metadata."""

    model: str  # tokenizer.ggml.model
    pre: str | None  # tokenizer.ggml.pre
    tokens: list[str]
    token_types: list[int]
    merges: list[str] | None
    scores: list[float] | None
    special_ids: dict[str, int]  # "bos", "eos", "unk", "pad", "eot", "eom" -> id
    add_bos_token: bool
    add_eos_token: bool
    add_space_prefix: bool  # SentencePiece: a "▁" before the text
    chat_template: str | None

    def token(self, role: str) -> str | None:
        token_id = self.special_ids.get(role)
        return None if token_id is None else self.tokens[token_id]


_SPECIAL_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
    "eom": "tokenizer.ggml.eom_token_id",
}
SUPPORTED_MODELS = ("gpt2", "llama")


def read_vocabulary(reader: GGUFReader) -> GGUFVocabulary:
    """The tokenizer metadata, checked: GGUFError names what is missing or unsupported."""
    model = metadata_string(reader, "tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        raise GGUFError(
            f"unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model); "
            f"supported: {', '.join(SUPPORTED_MODELS)}"
        )
    pre = _optional(reader, "tokenizer.ggml.pre", str)
    if model == "gpt2" and pre not in PRE_TOKENIZER_PATTERNS:
        problem = (
            "the GGUF file names no pre-tokenizer"
            if pre is None
            else f"unknown GGUF pre-tokenizer {pre!r}"
        )
        raise GGUFError(
            f"{problem} (tokenizer.ggml.pre); supported: {', '.join(PRE_TOKENIZER_PATTERNS)}"
        )
    tokens = _list(reader, "tokenizer.ggml.tokens", str)
    num_tokens = len(tokens)
    token_types = _optional_list(reader, "tokenizer.ggml.token_type", int)
    if token_types is None:
        token_types = [TokenType.NORMAL] * num_tokens
    merges = _optional_list(reader, "tokenizer.ggml.merges", str)
    scores = _optional_list(reader, "tokenizer.ggml.scores", float)
    if model == "gpt2" and merges is None:
        raise GGUFError("the GGUF file's gpt2 tokenizer has no tokenizer.ggml.merges")
    for name, values in (("token_type", token_types), ("scores", scores)):
        if values is not None and len(values) != num_tokens:
            raise GGUFError(
                f"tokenizer.ggml.{name} has {len(values)} entries for {num_tokens} tokens"
            )
    special_ids = {}
    for role, key in _SPECIAL_ID_KEYS.items():
        token_id = _optional(reader, key, int)
        if token_id is None:
            continue
        if not 0 <= token_id < num_tokens:
            raise GGUFError(f"{key} = {token_id} is outside the vocabulary ({num_tokens})")
        special_ids[role] = token_id
    default_bos = model == "llama" or pre in _LLAMA3_FAMILY  # as llama.cpp's loader
    add_bos = _optional(reader, "tokenizer.ggml.add_bos_token", bool)
    add_eos = _optional(reader, "tokenizer.ggml.add_eos_token", bool)
    return GGUFVocabulary(
        model=model,
        pre=pre,
        tokens=tokens,
        token_types=token_types,
        merges=merges,
        scores=scores,
        special_ids=special_ids,
        add_bos_token=default_bos if add_bos is None else add_bos,
        add_eos_token=bool(add_eos),
        add_space_prefix=_optional(reader, "tokenizer.ggml.add_space_prefix", bool) is not False,
        chat_template=_optional(reader, "tokenizer.chat_template", str),
    )


def tokenizer_from_gguf(reader: GGUFReader, source: str) -> Tokenizer:
    """The engine's ``Tokenizer`` for an opened GGUF file; ``source`` names it in errors."""
    vocabulary = read_vocabulary(reader)
    ids = vocabulary.special_ids
    eos_ids = [ids[role] for role in ("eos", "eot", "eom") if role in ids]
    return Tokenizer(
        build_backend(vocabulary),
        bos_token=vocabulary.token("bos"),
        eos_token=vocabulary.token("eos"),
        pad_token=vocabulary.token("pad"),
        unk_token=vocabulary.token("unk"),
        eos_token_ids=eos_ids,
        chat_template=vocabulary.chat_template,
        source=source,
    )


def build_backend(vocabulary: GGUFVocabulary) -> HFTokenizer:
    """The ``tokenizers.Tokenizer`` (what ``tokenizer.json`` holds) for ``vocabulary``."""
    if vocabulary.model == "gpt2":
        backend = _byte_level_bpe(vocabulary)
    else:
        backend = _sentencepiece_bpe(vocabulary)
    _add_tokens(backend, vocabulary)
    backend.post_processor = _post_processor(vocabulary)
    return backend


def _byte_level_bpe(vocabulary: GGUFVocabulary) -> HFTokenizer:
    assert vocabulary.merges is not None
    assert vocabulary.pre is not None
    vocab = {token: token_id for token_id, token in enumerate(vocabulary.tokens)}
    backend = HFTokenizer(
        models.BPE(
            vocab,
            _merge_pairs(vocabulary.merges),
            ignore_merges=vocabulary.pre in _LLAMA3_FAMILY,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(PRE_TOKENIZER_PATTERNS[vocabulary.pre]), behavior="isolated"
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(vocabulary: GGUFVocabulary) -> HFTokenizer:
    """A SentencePiece vocabulary as a byte-fallback BPE, as transformers' Llama tokenizer
    builds it: spaces spelled ``▁``, one ``▁`` before the text (unless
    ``tokenizer.ggml.add_space_prefix`` is false), characters without a token as ``<0xXX>``
    byte tokens. SentencePiece files carry scores, not merges: the merges are every split of a
    token into two tokens, ranked by the token's score."""
    vocab = {token: token_id for token_id, token in enumerate(vocabulary.tokens)}
    if vocabulary.merges is not None:
        pairs = _merge_pairs(vocabulary.merges)
    elif vocabulary.scores is not None:
        pairs = _merges_from_scores(vocabulary.tokens, vocabulary.scores, vocab)
    else:
        raise GGUFError("the GGUF file's llama tokenizer has neither merges nor scores")
    unk = vocabulary.token("unk")
    backend = HFTokenizer(
        models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    prefix = "first" if vocabulary.add_space_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme=prefix, split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocabulary.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merge_pairs(merges: Sequence[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise GGUFError(f"tokenizer.ggml.merges entry {merge!r} is not two tokens")
        pairs.append((parts[0], parts[1]))
    return pairs


def _merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best score first; ties: the longer left part,
    then the longer right part, then id order (transformers' ``generate_merges`` order)."""
    found: list[tuple[str, str, float]] = []
    for token_id, merged in enumerate(tokens):
        if vocab.get(merged) != token_id:
            continue  # a duplicate spelling: the last id wins, as in vocab
        splits = [
            (merged[:cut], merged[cut:])
            for cut in range(1, len(merged))
            if merged[:cut] in vocab and merged[cut:] in vocab
        ]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found += [(left, right, scores[token_id]) for left, right in splits]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_tokens(backend: HFTokenizer, vocabulary: GGUFVocabulary) -> None:
    """Control and unknown tokens (and the named bos/eos/unk/pad) as special added tokens,
    user-defined ones as plain added tokens, in id order; each keeps its id."""
    named = set(vocabulary.special_ids.values())
    added: list[AddedToken] = []
    for token_id, (token, kind) in enumerate(
        zip(vocabulary.tokens, vocabulary.token_types, strict=True)
    ):
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN) or token_id in named:
            added.append(AddedToken(token, special=True, normalized=False))
        elif kind == TokenType.USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    backend.add_tokens(added)


def _post_processor(vocabulary: GGUFVocabulary) -> TemplateProcessing | None:
    bos = vocabulary.token("bos") if vocabulary.add_bos_token else None
    eos = vocabulary.token("eos") if vocabulary.add_eos_token else None
    if bos is None and eos is None:
        return None
    prefix = [bos] if bos is not None else []
    suffix = [eos] if eos is not None else []
    specials = [(t, vocabulary.tokens.index(t)) for t in {*prefix, *suffix}]
    return TemplateProcessing(
        single=[*prefix, "$A", *suffix],
        pair=[*prefix, "$A", *suffix, *prefix, "$B:1", *suffix],
        special_tokens=specials,
    )


def _optional(reader: GGUFReader, key: str, kind: type[Any]) -> Any:
    if reader.get_field(key) is None:
        return None
    value = metadata_value(reader, key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise GGUFError(f"GGUF metadata {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def _optional_list(reader: GGUFReader, key: str, kind: type[Any]) -> list[Any] | None:
    if reader.get_field(key) is None:
        return None
    return _list(reader, key, kind)


def _list(reader: GGUFReader, key: str, kind: type[Any]) -> list[Any]:
    values = metadata_value(reader, key)
    if not isinstance(values, list):
        raise GGUFError(f"GGUF metadata {key!r} must be an array, got {type(values).__name__}")
    if kind is float:
        values = [float(v) if isinstance(v, int) else v for v in values]
    if values and not all(isinstance(v, kind) for v in values):
        raise GGUFError(f"GGUF metadata {key!r} must be an array of {kind.__name__}")
    return values
