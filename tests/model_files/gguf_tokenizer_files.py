"""Small GGUF files holding a tokenizer, written as llama.cpp's converter writes them, and the
awkward texts the GGUF tokenizer tests encode.

A byte-level BPE is trained with ``tokenizers`` on the demo corpus with a pre-tokenizer's own
split, then stored under llama.cpp's keys: ``tokenizer.ggml.tokens`` in id order, ``merges``
as ``"left right"`` strings, ``token_type`` (CONTROL for the special tokens, USER_DEFINED for
``<think>``), bos/eos/pad ids, ``add_bos_token``, ``pre`` and the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from backend_engine.demo.corpus import iter_demo_corpus
from model_files.gguf_tokenizer import PRE_TOKENIZER_PATTERNS, TokenType

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
USER_DEFINED_TOKENS = ("<think>",)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_EXTRA_TRAINING_TEXT = (
    "日本語のテキスト、中文字符测试，한국어 문장. Привет, мир! مرحبا بالعالم שלום עולם",
    "Emoji 🙂🚀👍🏽❤️ 👨‍👩‍👧 café naïve crème brûlée e\u0301 Ａｂｃ ½ ² ١٢٣",
    "1234567890 3.14159 2026-12-01 0x1F 1e-5 100,000 $42 50% #1",
    "\t\tindented\n    spaces\r\nwindows\n\n\nblank  lines   here",
)

# Texts that have tripped up byte-level BPE ports: unicode of every kind, long digit runs,
# code, whitespace runs, special tokens in the text, control characters, the empty string.
AWKWARD_TEXTS = (
    "",
    "Hello, world!",
    "The capital of France is Paris.",
    "It's what they'll say; we'd've known. I'M SHOUTING, DON'T",
    "Crème brûlée, naïve Jürgen, Ångström, façade",
    "中文字符测试，日本語のテキスト、한국어 문장",
    "Привет, мир! Ελληνικά",
    "مرحبا بالعالم — שלום עולם (right to left)",
    "Emoji 🙂🚀👍🏽❤️ and a family 👨‍👩‍👧 too",
    "combining: e\u0301 a\u0308\u0301 \u0915\u094d\u0937 Z\u0351\u0352\u0353",
    "digits: 1 12 123 1234 12345678901234567890 3.14159 -0.5e10 ½ ² ١٢٣",
    "  1 23  456   7890",
    "x1y22z333 v2.0.1 0xDEADBEEF",
    "def f(x):\n\treturn [i ** 2 for i in range(x)]  # squares\n\n\nprint(f(10))\n",
    'if (a != b && c <= d) { return "ok"; } // done',
    "   leading and trailing spaces   ",
    "tabs\t\tand\t mixed \t whitespace",
    "\n\n\nnewlines\n \n  \n",
    "\r\n\r\nwindows\r\nlines\r\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|endoftext|><|im_end|>",
    "<think>reasoning</think> after",
    "<|im_start|notquite <|im_end",
    "control: \x00\x01\x07\x1b[0m\x7f\u200b\u200d\ufeff end",
    "fullwidth Ａｂｃ１２３ and ligature ﬁ",
    "a" * 300,
    " " * 40 + "x",
)
CONVERSATIONS: tuple[list[dict[str, Any]], ...] = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse.  "},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Und 中文? 🙂 <|im_end|>"},
    ],
    [{"role": "user", "content": ""}],
)


def train_byte_level_bpe(pre: str, vocab_size: int = 700) -> HFTokenizer:
    """A byte-level BPE trained with ``pre``'s split; special tokens first (ids 0..3)."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERNS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[
            *(AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS),
            *(AddedToken(t, special=False, normalized=False) for t in USER_DEFINED_TOKENS),
        ],
        show_progress=False,
    )
    corpus = [*_EXTRA_TRAINING_TEXT, *iter_demo_corpus(30_000)]
    backend.train_from_iterator(corpus, trainer)
    return backend


def add_byte_level_tokenizer(
    writer: gguf.GGUFWriter,
    backend: HFTokenizer,
    pre: str,
    *,
    add_bos_token: bool | None = None,
    chat_template: str | None = CHATML_TEMPLATE,
    num_unused: int = 0,
) -> None:
    """Write ``backend``'s vocabulary under llama.cpp's tokenizer keys, plus ``num_unused``
    ``[PAD<id>]`` fillers typed UNUSED (as llama.cpp pads Qwen2's vocabulary)."""
    spec = json.loads(backend.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    types = [
        TokenType.CONTROL
        if t in CONTROL_TOKENS
        else TokenType.USER_DEFINED
        if t in USER_DEFINED_TOKENS
        else TokenType.NORMAL
        for t in tokens
    ]
    tokens += [f"[PAD{len(tokens) + n}]" for n in range(num_unused)]
    types += [TokenType.UNUSED] * num_unused
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    if add_bos_token is not None:
        writer.add_add_bos_token(add_bos_token)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def add_llama_metadata(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """The model metadata transformers needs to open the file (a tiny Llama)."""
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size)


def write_tokenizer_gguf(
    path: Path,
    pre: str,
    *,
    add_bos_token: bool | None = None,
    chat_template: str | None = CHATML_TEMPLATE,
    backend: HFTokenizer | None = None,
    num_unused: int = 0,
) -> Path:
    """A GGUF file with a trained tokenizer and a tiny Llama's metadata, no tensors."""
    backend = backend or train_byte_level_bpe(pre)
    writer = gguf.GGUFWriter(path, "llama")
    add_llama_metadata(writer, backend.get_vocab_size() + num_unused)
    add_byte_level_tokenizer(
        writer,
        backend,
        pre,
        add_bos_token=add_bos_token,
        chat_template=chat_template,
        num_unused=num_unused,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + "
    "eos_token }}{% endif %}{% endfor %}"
)


def write_sentencepiece_gguf(path: Path, *, add_space_prefix: bool | None = None) -> Path:
    """A llama.cpp SentencePiece (``llama``) vocabulary: ``<unk>``, ``<s>``, ``</s>``, the 256
    ``<0xXX>`` byte tokens, then pieces learned by BPE over ``▁``-spelled words, each merged
    piece scored by its merge's rank (as SentencePiece's BPE scores them); no merges stored."""
    backend = HFTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False)
    backend.train_from_iterator([*_EXTRA_TRAINING_TEXT[:2], *iter_demo_corpus(20_000)], trainer)
    spec = json.loads(backend.to_str())
    merged = ["".join(m.split(" ") if isinstance(m, str) else m) for m in spec["model"]["merges"]]
    rank = {token: n for n, token in enumerate(merged)}
    learned = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].__getitem__)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256]
    scores = [0.0] * len(tokens)
    for token in learned:
        if token not in tokens:
            tokens.append(token)
            types.append(TokenType.NORMAL)
            scores.append(-float(rank[token]) if token in rank else -1e6)
    writer = gguf.GGUFWriter(path, "llama")
    add_llama_metadata(writer, len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.add_chat_template(LLAMA_CHAT_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
