"""The tokenizer half of writing a GGUF file: llama.cpp's ``tokenizer.*`` metadata.

From a GGUF source the fields are copied as they are. From a Hugging Face directory the
``tokenizer.json`` is converted into what ``model_files.gguf_tokenizer`` reads back (and
llama.cpp reads): a byte-level BPE (``tokenizer.ggml.model = gpt2``) with its tokens in id
order, merges, token types (special added tokens CONTROL, other added tokens USER_DEFINED),
the special token ids, ``add_bos_token`` and the chat template.

How text is split before the merges has to be one of the splits llama.cpp names
(``tokenizer.ggml.pre``); it is recognized from the ``pre_tokenizer`` (GPT-2's byte-level
regex, SmolLM's digits then GPT-2, or one of ``PRE_TOKENIZER_PATTERNS`` as a ``Split``).
Then, as llama.cpp's converter checks a hash of its tokenization, the tokenizer rebuilt from
the metadata must encode a set of awkward texts exactly as ``tokenizer.json`` does; anything
else (a SentencePiece or WordPiece model, a normalizer, an unknown split, a tokenizer that
encodes differently) is refused with a ``GGUFError`` that says what.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType, GGUFWriter

from model_files.gguf_metadata import GGUFError
from model_files.gguf_tokenizer import (
    PRE_TOKENIZER_PATTERNS,
    GGUFVocabulary,
    TokenType,
    build_backend,
)
from model_files.tokenizer import Tokenizer

TOKENIZER_KEY_PREFIX = "tokenizer."
_EXTRA_EOS_ROLES = ("eot", "eom")  # GGUF's other ids that end a generation
# Texts the rebuilt tokenizer must encode as tokenizer.json does (with and without the
# special tokens the post-processor adds): digits, contractions, scripts, emoji, whitespace
# runs, code; the added tokens are checked too, each inside a text.
CHECK_TEXTS = (
    "",
    "Hello, world! The capital of France is Paris.",
    "It's what they'll say; we'd've known. I'M SHOUTING, DON'T",
    "digits: 1 12 123 1234 12345678901 3.14159 -0.5e10 2026-12-02 ½ ² ١٢٣",
    "Crème brûlée, naïve, Ångström; 中文字符测试，日本語のテキスト、한국어 Привет",
    "Emoji 🙂🚀👍🏽❤️ 👨‍👩‍👧 e\u0301 ﬁ Ａｂｃ",
    "def f(x):\n\treturn [i ** 2 for i in range(x)]  # squares\n\n\nprint(f(10))\n",
    "   leading and trailing   \r\n\r\n  \n\t\tmixed \t whitespace   ",
    "x1y22z333 v2.0.1 0xDEADBEEF",
)


def copy_tokenizer_fields(reader: GGUFReader, writer: GGUFWriter) -> None:
    """Every ``tokenizer.*`` field of ``reader``, as stored, into ``writer``."""
    for field in reader.fields.values():
        if not field.name.startswith(TOKENIZER_KEY_PREFIX):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type)


def write_vocabulary(writer: GGUFWriter, vocabulary: GGUFVocabulary) -> None:
    """``vocabulary`` under llama.cpp's keys (what ``read_vocabulary`` reads back)."""
    writer.add_tokenizer_model(vocabulary.model)
    if vocabulary.pre is not None:
        writer.add_tokenizer_pre(vocabulary.pre)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.token_types)
    if vocabulary.merges is not None:
        writer.add_token_merges(vocabulary.merges)
    if vocabulary.scores is not None:
        writer.add_token_scores(vocabulary.scores)
    setters = {
        "bos": writer.add_bos_token_id,
        "eos": writer.add_eos_token_id,
        "unk": writer.add_unk_token_id,
        "pad": writer.add_pad_token_id,
        "eot": writer.add_eot_token_id,
        "eom": writer.add_eom_token_id,
    }
    for role, token_id in vocabulary.special_ids.items():
        setters[role](token_id)
    writer.add_add_bos_token(vocabulary.add_bos_token)
    writer.add_add_eos_token(vocabulary.add_eos_token)
    if vocabulary.chat_template is not None:
        writer.add_chat_template(vocabulary.chat_template)


def vocabulary_from_hf(directory: Path, vocab_size: int) -> GGUFVocabulary:
    """The GGUF vocabulary of a Hugging Face directory's tokenizer, checked to encode as it
    does; ``vocab_size`` (the model's) may exceed the tokenizer's: the rest is padded with
    UNUSED ``[PAD<id>]`` tokens, as llama.cpp pads."""
    tokenizer = Tokenizer.from_pretrained(directory)
    backend = tokenizer.backend
    spec = json.loads(backend.to_str())
    model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
    if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel":
        raise GGUFError(
            f"only byte-level BPE tokenizers can be written to GGUF; {directory}'s is a "
            f"{model.get('type')} model with a {decoder.get('type')} decoder"
        )
    if spec.get("normalizer") is not None:
        raise GGUFError(
            f"the tokenizer's {spec['normalizer'].get('type')} normalizer has no GGUF equivalent"
        )
    pre = pre_tokenizer_name(spec.get("pre_tokenizer"))
    vocab = backend.get_vocab(with_added_tokens=True)
    num_tokens = len(vocab)
    if sorted(vocab.values()) != list(range(num_tokens)):
        raise GGUFError("the tokenizer's ids are not 0..N-1 without gaps")
    if num_tokens > vocab_size:
        raise GGUFError(
            f"the tokenizer has {num_tokens} tokens but the model's vocab_size is {vocab_size}"
        )
    tokens = sorted(vocab, key=vocab.__getitem__)
    added = backend.get_added_tokens_decoder()
    token_types = [
        TokenType.NORMAL
        if token_id not in added
        else TokenType.CONTROL
        if added[token_id].special
        else TokenType.USER_DEFINED
        for token_id in range(num_tokens)
    ]
    tokens += [f"[PAD{token_id}]" for token_id in range(num_tokens, vocab_size)]
    token_types += [TokenType.UNUSED] * (vocab_size - num_tokens)
    special_ids = _special_ids(tokenizer)
    probe = "a"
    with_special = tokenizer.encode(probe)
    plain = tokenizer.encode(probe, add_special_tokens=False)
    bos, eos = special_ids.get("bos"), special_ids.get("eos")
    vocabulary = GGUFVocabulary(
        model="gpt2",
        pre=pre,
        tokens=tokens,
        token_types=[int(t) for t in token_types],
        merges=[_merge_string(merge) for merge in model.get("merges", [])],
        scores=None,
        special_ids=special_ids,
        add_bos_token=bos is not None and with_special[:1] == [bos] and plain[:1] != [bos],
        add_eos_token=eos is not None and with_special[-1:] == [eos] and plain[-1:] != [eos],
        add_space_prefix=False,
        chat_template=tokenizer.chat_template,
    )
    check_same_encoding(tokenizer, vocabulary)
    return vocabulary


def pre_tokenizer_name(spec: dict[str, Any] | None) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a ``tokenizer.json`` pre-tokenizer."""
    found = spec or {}
    listed = found.get("pretokenizers") if found.get("type") == "Sequence" else [found]
    parts: list[dict[str, Any]] = [p for p in listed or [] if p]
    kinds = [p.get("type") for p in parts]
    byte_level = parts[-1] if kinds and kinds[-1] == "ByteLevel" else None
    if byte_level is not None and not byte_level.get("add_prefix_space", False):
        uses_regex = byte_level.get("use_regex", True)
        if kinds == ["ByteLevel"] and uses_regex:
            return "gpt-2"
        if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and uses_regex:
            return "smollm"
        split = parts[0]
        if (
            kinds == ["Split", "ByteLevel"]
            and not uses_regex
            and split.get("behavior") == "Isolated"
            and not split.get("invert", False)
        ):
            pattern = (split.get("pattern") or {}).get("Regex")
            for name, known in PRE_TOKENIZER_PATTERNS.items():
                if pattern == known:
                    return name
    raise GGUFError(
        "the tokenizer's pre-tokenizer is not one llama.cpp names (tokenizer.ggml.pre): "
        f"{json.dumps(spec)[:200]}"
    )


def check_same_encoding(tokenizer: Tokenizer, vocabulary: GGUFVocabulary) -> None:
    """Refuse a vocabulary whose rebuilt tokenizer encodes any check text differently."""
    rebuilt = build_backend(vocabulary)
    added = [token.content for token in tokenizer.backend.get_added_tokens_decoder().values()]
    texts = [*CHECK_TEXTS, *(f"a {token}b{token} c" for token in added)]
    for text in texts:
        for add_special_tokens in (True, False):
            expected = tokenizer.encode(text, add_special_tokens=add_special_tokens)
            got = rebuilt.encode(text, add_special_tokens=add_special_tokens).ids
            if got != expected:
                raise GGUFError(
                    f"the tokenizer written to GGUF would encode {text[:60]!r} as "
                    f"{got[:12]}..., tokenizer.json as {expected[:12]}...; it cannot be "
                    "converted exactly"
                )


def _special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """bos, eos (the named eos token), unk and pad; further ids that end a generation
    (``generation_config.json``) as eot and eom."""
    backend = tokenizer.backend
    ids: dict[str, int] = {}
    for role, token in (
        ("bos", tokenizer.bos_token),
        ("eos", tokenizer.eos_token),
        ("unk", tokenizer.unk_token),
        ("pad", tokenizer.pad_token),
    ):
        token_id = backend.token_to_id(token) if token else None
        if token_id is not None:
            ids[role] = token_id
    stop_ids = sorted(tokenizer.eos_token_ids)
    if "eos" not in ids and stop_ids:
        ids["eos"] = stop_ids[0]
    others = [token_id for token_id in stop_ids if token_id != ids.get("eos")]
    if len(others) > len(_EXTRA_EOS_ROLES):
        raise GGUFError(
            f"{len(stop_ids)} token ids end a generation ({stop_ids}); GGUF holds at most "
            f"{len(_EXTRA_EOS_ROLES) + 1} (eos, eot, eom)"
        )
    ids.update(zip(_EXTRA_EOS_ROLES, others, strict=False))
    return ids


def _merge_string(merge: str | list[str]) -> str:
    parts = merge.split(" ") if isinstance(merge, str) else list(merge)
    if len(parts) != 2 or any(" " in part for part in parts):
        raise GGUFError(f"the merge {merge!r} is not two tokens without spaces")
    return " ".join(parts)
