"""Prompt-token counting in the gateway with tiktoken, equal to what the engine counts.

Two builders, both offline:

- ``from_checkpoint(path)`` converts one of our checkpoints' byte-level BPE ``tokenizer.json``
  (or the one rebuilt from a ``.gguf`` file's metadata) into a ``tiktoken.Encoding`` and
  renders the checkpoint's chat template with the engine's own code. It counts what the
  engine's server counts (``backend_engine/server/routes.py``): a completions prompt is
  ``Tokenizer.encode(prompt)``, so with the tokens the tokenizer's post-processor adds
  (Llama's BOS); a chat is ``Tokenizer.encode_chat`` of its messages and tools, rendered by
  ``Tokenizer.render_chat`` from the client's JSON as the engine renders them (tool turns,
  the developer role, text parts: ``model_files/chat_rendering.py``), the template writing its
  own BOS. The tools go to the renderer as the engine's request model dumps them
  (:func:`engine_tools`), so a client's key order or extra keys count as the engine counts.
  A tokenizer tiktoken cannot reproduce exactly raises ``UnsupportedTokenizer`` (a
  ``ValueError``) saying why; ``exact_counter(path)`` then counts with the engine's own
  tokenizer (``TokenizerCounter``) instead.
- ``for_openai_model(name)`` counts with ``cl100k_base`` or ``o200k_base``, loaded from the rank
  files shipped in ``gateway/admission/encodings`` (never downloaded), following OpenAI's
  cookbook rules, tools included (its approximation: names, descriptions and top-level
  properties).

Only ``tiktoken``, ``tokenizers``, ``jinja2``, pydantic (the request models) and ``gguf`` (for
a GGUF file) are imported: never torch or transformers.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import logging
import re
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import tiktoken
from tiktoken.model import encoding_name_for_model
from tiktoken_ext import openai_public
from tokenizers import Tokenizer as HFTokenizer

from gateway.admission.tiktoken_vocabulary import (
    TiktokenVocabulary,
    UnsupportedTokenizer,
    tiktoken_vocabulary,
)
from model_files.checkpoint import load_tokenizer
from model_files.tokenizer import Tokenizer
from openai_protocol.request_models import Tool

logger = logging.getLogger(__name__)
Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]]
# A prompt shorter than this is tokenized on the event loop (microseconds: a thread hand-off
# costs more); a longer one on a worker thread (1 MiB takes tens of milliseconds).
INLINE_TOKENIZE_CHARS = 16_384
OPENAI_ENCODINGS = ("cl100k_base", "o200k_base")
DEFAULT_OPENAI_ENCODING = "cl100k_base"
# OpenAI cookbook, "How to count tokens with tiktoken" (gpt-3.5-turbo-0613 and later, gpt-4*,
# gpt-4o*): each message costs 3 tokens of framing plus its encoded values, a "name" one more,
# and the reply is primed with 3 tokens (<|start|>assistant<|message|>).
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
TOKENS_PER_REPLY = 3
# The same cookbook, "Counting tokens for chat completions with tool calls": an approximation
# of how OpenAI renders ``tools`` (exact on its examples), from each function's name and
# description and its parameters' top-level properties (name, type, description, enum).
TOKENS_PER_FUNCTION = {"o200k_base": 7, "cl100k_base": 10}  # gpt-4o*; gpt-3.5-turbo, gpt-4
TOKENS_PER_PROPERTIES = 3
TOKENS_PER_PROPERTY = 3
TOKENS_PER_ENUM = -3
TOKENS_PER_ENUM_ITEM = 3
TOKENS_AFTER_FUNCTIONS = 12


class TokenCounter(Protocol):
    """Prompt tokens as the model's server counts them, for reservations and limits."""

    @property
    def fingerprint(self) -> str:
        """Equal for two counters that count every prompt the same (a shared tokenizer)."""
        ...

    def count_text(self, text: str) -> int:
        """Tokens of plain text, nothing added."""
        ...

    def count_prompt(self, prompt: str, limit: int | None = None) -> int:
        """A ``/v1/completions`` text prompt as the server encodes it.

        ``limit``: a prompt whose length alone shows it has more tokens is not tokenized; the
        answer is then that lower bound (above ``limit``), not its count.
        """
        ...

    def count_chat(
        self, messages: Messages, limit: int | None = None, tools: Tools | None = None
    ) -> int:
        """A ``/v1/chat/completions`` conversation and its ``tools`` (OpenAI's JSON, as the
        client sent them), rendered as the server renders them; ``limit`` as for
        ``count_prompt``."""
        ...


@dataclass(frozen=True)
class PromptTokens:
    """A prompt as an exact counter (`ExactCounter`) tokenizes it: its count and the ids the
    engine's server will make of it, or only a lower bound above the asked limit (``ids``
    None: the prompt was too long by its length alone to be tokenized)."""

    count: int
    ids: Sequence[int] | None


def _longest_token_bytes(encoding: tiktoken.Encoding) -> int:
    """The most bytes one token stands for, special tokens included."""
    specials = (len(s.encode("utf-8")) for s in encoding.special_tokens_set)
    return max(max(map(len, encoding.token_byte_values())), *specials, 1)


def _fewest_tokens(num_chars: int, max_chars_per_token: int) -> int:
    """No text of ``num_chars`` characters encodes to fewer tokens: a character is at least
    one byte, a token at most ``max_chars_per_token`` of them."""
    return -(-num_chars // max_chars_per_token)


# --- OpenAI encodings, from package data -------------------------------------------------------


def _read_rank_file(blobpath: str, expected_hash: str | None = None) -> dict[bytes, int]:
    """tiktoken's ``load_tiktoken_bpe``, reading ``gateway/admission/encodings/<name>`` instead."""
    name = blobpath.rsplit("/", 1)[-1]
    resource = resources.files("gateway.admission.encodings") / name
    if not resource.is_file():
        raise ValueError(f"{name} is not shipped in gateway/admission/encodings ({blobpath})")
    data = resource.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if expected_hash is None or digest != expected_hash:
        raise ValueError(
            f"gateway/admission/encodings/{name} has sha256 {digest}, tiktoken expects "
            f"{expected_hash}; regenerate it with deploy/make_tiktoken_files.py"
        )
    return {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in data.splitlines() if line)
    }


def load_openai_encoding(name: str) -> tiktoken.Encoding:
    """``cl100k_base`` or ``o200k_base`` without network.

    The pattern and special tokens are tiktoken's own: we run the constructor from the installed
    ``tiktoken_ext/openai_public.py`` with its ``load_tiktoken_bpe`` pointed at our package
    data (a copy of the function with other globals; nothing is patched). The rank file must
    have the sha256 that constructor expects. Loading takes up to a second: build once.
    """
    if name not in OPENAI_ENCODINGS:
        raise ValueError(f"encoding must be one of {OPENAI_ENCODINGS}, got {name!r}")
    constructor = openai_public.ENCODING_CONSTRUCTORS[name]
    offline = types.FunctionType(
        constructor.__code__,
        {**constructor.__globals__, "load_tiktoken_bpe": _read_rank_file},
        constructor.__name__,
        constructor.__defaults__,
        constructor.__closure__,
    )
    return tiktoken.Encoding(**offline())


def openai_encoding_name(model: str) -> str:
    """tiktoken's model table, limited to the encodings we ship; ``cl100k_base`` otherwise."""
    try:
        name = encoding_name_for_model(model)
    except KeyError:
        return DEFAULT_OPENAI_ENCODING
    if name == "o200k_harmony":  # same ranks and pattern; only the special tokens differ
        return "o200k_base"
    return name if name in OPENAI_ENCODINGS else DEFAULT_OPENAI_ENCODING


class OpenAITokenCounter:
    """Counts as OpenAI's cookbook does; special-token text in content is plain text."""

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self.encoding = encoding
        self._max_chars_per_token = _longest_token_bytes(encoding)
        self._tokens_per_function = TOKENS_PER_FUNCTION.get(encoding.name, 7)

    @property
    def fingerprint(self) -> str:
        return f"openai:{self.encoding.name}"

    def count_text(self, text: str) -> int:
        return len(self.encoding.encode_ordinary(text))

    def count_prompt(self, prompt: str, limit: int | None = None) -> int:
        fewest = _fewest_tokens(len(prompt), self._max_chars_per_token)
        if limit is not None and fewest > limit:
            return fewest
        return self.count_text(prompt)

    def count_chat(
        self, messages: Messages, limit: int | None = None, tools: Tools | None = None
    ) -> int:
        num_tokens = TOKENS_PER_REPLY + self._count_tools(tools or [])
        for message in messages:
            num_tokens += TOKENS_PER_MESSAGE
            for key, value in message.items():
                if value is None:
                    continue
                num_tokens += self.count_text(_as_text(value))
                if key == "name":
                    num_tokens += TOKENS_PER_NAME
        return num_tokens

    def _count_tools(self, tools: Tools) -> int:
        """The cookbook's ``num_tokens_for_tools`` less the messages (nested properties, and
        anything else a function's parameters say, are not counted: it is an estimate)."""
        if not tools:
            return 0
        num_tokens = TOKENS_AFTER_FUNCTIONS
        for tool in tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict):
                continue
            num_tokens += self._tokens_per_function
            description = _as_text(function.get("description") or "").removesuffix(".")
            num_tokens += self.count_text(f"{_as_text(function.get('name'))}:{description}")
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            if not isinstance(properties, dict) or not properties:
                continue
            num_tokens += TOKENS_PER_PROPERTIES
            for name, spec in properties.items():
                spec = spec if isinstance(spec, dict) else {}
                num_tokens += TOKENS_PER_PROPERTY
                enum = spec.get("enum")
                if isinstance(enum, list):
                    num_tokens += TOKENS_PER_ENUM
                    for item in enum:
                        num_tokens += TOKENS_PER_ENUM_ITEM + self.count_text(_as_text(item))
                kind = _as_text(spec.get("type"))
                description = _as_text(spec.get("description") or "").removesuffix(".")
                num_tokens += self.count_text(f"{name}:{kind}:{description}")
        return num_tokens


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def for_openai_model(model: str) -> OpenAITokenCounter:
    return OpenAITokenCounter(load_openai_encoding(openai_encoding_name(model)))


# --- Checkpoint tokenizers ---------------------------------------------------------------------


def engine_tools(tools: Tools | None) -> Tools | None:
    """``tools`` as the engine's server hands them to the renderer
    (``ChatCompletionRequest.tool_dicts``): each through the request model, dumped without
    its nulls, so key order and unknown keys are the model's, not the client's. Raises
    ``ValueError`` (pydantic's) for a tool the model refuses (the field rules let none by)."""
    if not tools:
        return None
    return [Tool.model_validate(tool).model_dump(exclude_none=True) for tool in tools]


def _fingerprint(tokenizer: Tokenizer) -> str:
    """The files' content that decides a count: the tokenizer, its template, special tokens."""
    parts = [
        tokenizer.backend.to_str(),
        tokenizer.chat_template or "",
        *(t or "" for t in (tokenizer.bos_token, tokenizer.eos_token)),
        *(t or "" for t in (tokenizer.pad_token, tokenizer.unk_token)),
    ]
    return hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()


class CheckpointTokenCounter:
    """Counts exactly as the engine's ``Tokenizer`` does, with a tiktoken ``Encoding``."""

    def __init__(self, tokenizer: Tokenizer, vocabulary: TiktokenVocabulary, name: str) -> None:
        backend = tokenizer.backend
        if backend.truncation is not None or backend.padding is not None:
            raise UnsupportedTokenizer("the tokenizer truncates or pads what it encodes")
        # What the post-processor adds to one sequence (Llama's BOS; Qwen2's nothing), always
        # the same tokens whatever the text.
        self._num_added_tokens: int = backend.num_special_tokens_to_add(is_pair=False)
        self._added_before, self._added_after = _added_tokens(backend)
        self.fingerprint = _fingerprint(tokenizer)
        try:
            self.encoding = tiktoken.Encoding(
                name=name,
                pat_str=vocabulary.pat_str,
                mergeable_ranks=vocabulary.mergeable_ranks,
                special_tokens=vocabulary.special_tokens,
            )
        except ValueError as exc:  # the Rust side rejects the regex
            raise UnsupportedTokenizer(f"tiktoken cannot use the pattern: {exc}") from exc
        self._render = tokenizer.render_chat
        self._backend = backend
        self._unencodable = (
            re.compile(vocabulary.unencodable) if vocabulary.unencodable is not None else None
        )
        self._normalize = vocabulary.normalize
        self._rank_to_id = vocabulary.rank_to_id
        self._special_ranks = vocabulary.special_tokens
        # A character is at least one byte and a token at most the longest token's bytes; NFC
        # may compose up to 4 characters into one (e.g. U+1F87), so a normalized text is read
        # as 4 times shorter.
        shrink = 4 if vocabulary.normalize is not None else 1
        self._max_chars_per_token = _longest_token_bytes(self.encoding) * shrink
        # HF matches added tokens leftmost-longest before normalizing; tiktoken's own matching
        # is leftmost-first in no set order, so it only serves when no token prefixes another.
        contents = sorted(vocabulary.special_tokens)
        is_prefix_free = not any(b.startswith(a) for a, b in itertools.pairwise(contents))
        self._special_split: re.Pattern[str] | None = None
        if contents and (self._normalize is not None or not is_prefix_free):
            by_length = sorted(contents, key=len, reverse=True)
            self._special_split = re.compile("(" + "|".join(map(re.escape, by_length)) + ")")

    def _segments(self, text: str) -> Iterator[tuple[str, bool]]:
        """``(piece, is_added_token)`` in order."""
        if self._special_split is None:
            yield text, False
            return
        for n, piece in enumerate(self._special_split.split(text)):
            if n % 2:
                yield piece, True
            elif piece:
                yield piece, False

    def _encode_ranks(self, text: str) -> list[int]:
        if self._special_split is None and self._normalize is None:
            return self.encoding.encode(text, allowed_special="all")
        ranks: list[int] = []
        for piece, is_added in self._segments(text):
            if is_added:
                ranks.append(self._special_ranks[piece])
            else:
                ranks += self.encoding.encode_ordinary(
                    self._normalize(piece) if self._normalize else piece
                )
        return ranks

    def _has_unencodable(self, text: str) -> bool:
        return self._unencodable is not None and self._unencodable.search(text) is not None

    def encode_text(self, text: str) -> list[int]:
        """Token ids, as ``Tokenizer.encode(text, add_special_tokens=False)``."""
        if self._has_unencodable(text):
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        ranks = self._encode_ranks(text)
        if self._rank_to_id is None:
            return ranks
        return [self._rank_to_id[rank] for rank in ranks]

    def encode_prompt(self, prompt: str) -> list[int]:
        """A completions prompt's ids, as ``Tokenizer.encode(prompt)``: with what the
        post-processor adds (Llama's BOS)."""
        return [*self._added_before, *self.encode_text(prompt), *self._added_after]

    def encode_chat(self, messages: Messages, tools: Tools | None = None) -> list[int]:
        return self.encode_text(self._render(messages, engine_tools(tools)))

    def count_text(self, text: str) -> int:
        if self._has_unencodable(text):
            return len(self._backend.encode(text, add_special_tokens=False).ids)
        return len(self._encode_ranks(text))

    def count_prompt(self, prompt: str, limit: int | None = None) -> int:
        """``len(Tokenizer.encode(prompt))``: the text and what the post-processor adds."""
        return self._count_within(prompt, limit) + self._num_added_tokens

    def count_chat(
        self, messages: Messages, limit: int | None = None, tools: Tools | None = None
    ) -> int:
        """Raises ``ValueError`` (``ChatRenderingError`` naming the field) or
        ``jinja2.TemplateError`` where the engine's renderer would."""
        return self._count_within(self._render(messages, engine_tools(tools)), limit)

    def tokenize_prompt(self, prompt: str, limit: int | None = None) -> PromptTokens:
        """``count_prompt`` with the ids (``encode_prompt``) where it tokenizes."""
        fewest = self._fewest_within(prompt, limit)
        if fewest is not None:
            return PromptTokens(fewest + self._num_added_tokens, None)
        ids = self.encode_prompt(prompt)
        return PromptTokens(len(ids), ids)

    def tokenize_chat(
        self, messages: Messages, limit: int | None = None, tools: Tools | None = None
    ) -> PromptTokens:
        """``count_chat`` with the ids (``encode_chat``) where it tokenizes."""
        text = self._render(messages, engine_tools(tools))
        fewest = self._fewest_within(text, limit)
        if fewest is not None:
            return PromptTokens(fewest, None)
        ids = self.encode_text(text)
        return PromptTokens(len(ids), ids)

    def _count_within(self, text: str, limit: int | None) -> int:
        fewest = self._fewest_within(text, limit)
        return self.count_text(text) if fewest is None else fewest

    def _fewest_within(self, text: str, limit: int | None) -> int | None:
        """The fewest tokens ``text`` can make where that alone is above ``limit``; else None
        (it must be tokenized)."""
        fewest = _fewest_tokens(len(text), self._max_chars_per_token)
        # A character the vocabulary cannot encode (TiktokenVocabulary.unencodable) makes no
        # token: no lower bound then.
        if limit is not None and fewest > limit and not self._has_unencodable(text):
            return fewest
        return None


class TokenizerCounter:
    """Counts with the engine's own ``Tokenizer`` (HF ``tokenizers``), for a tokenizer tiktoken
    cannot reproduce (a SentencePiece vocabulary with byte fallback): exact, slower, and every
    prompt is tokenized (no bound from its length)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.fingerprint = "tokenizers:" + _fingerprint(tokenizer)

    def count_text(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, prompt: str) -> list[int]:
        return self._tokenizer.encode(prompt)

    def encode_chat(self, messages: Messages, tools: Tools | None = None) -> list[int]:
        return self._tokenizer.encode_chat(messages, tools=engine_tools(tools))

    def count_prompt(self, prompt: str, limit: int | None = None) -> int:
        return len(self._tokenizer.encode(prompt))

    def count_chat(
        self, messages: Messages, limit: int | None = None, tools: Tools | None = None
    ) -> int:
        """Raises ``ValueError``/``jinja2.TemplateError`` where the engine's renderer would."""
        return len(self.encode_chat(messages, tools))

    def tokenize_prompt(self, prompt: str, limit: int | None = None) -> PromptTokens:
        ids = self.encode_prompt(prompt)
        return PromptTokens(len(ids), ids)

    def tokenize_chat(
        self, messages: Messages, limit: int | None = None, tools: Tools | None = None
    ) -> PromptTokens:
        ids = self.encode_chat(messages, tools)
        return PromptTokens(len(ids), ids)


def _added_tokens(backend: HFTokenizer) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after one sequence's own (Llama: [BOS],
    []): the same whatever the text, as ``num_special_tokens_to_add`` assumes."""
    own = backend.encode(_PROBE_TEXT, add_special_tokens=False).ids
    full = backend.encode(_PROBE_TEXT).ids
    for start in range(len(full) - len(own) + 1):
        if full[start : start + len(own)] == own:
            return full[:start], full[start + len(own) :]
    raise UnsupportedTokenizer("the post-processor changes a sequence's own tokens")


_PROBE_TEXT = "Hello world"
# The counters whose ids equal the engine tokenizer's (the others only count).
ExactCounter = CheckpointTokenCounter | TokenizerCounter


def _tiktoken_counter(tokenizer: Tokenizer, name: str) -> CheckpointTokenCounter:
    vocabulary = tiktoken_vocabulary(json.loads(tokenizer.backend.to_str()))
    return CheckpointTokenCounter(tokenizer, vocabulary, name=name)


def from_checkpoint(path: str | Path) -> CheckpointTokenCounter:
    """A tiktoken counter for a checkpoint directory or ``.gguf`` file (its tokenizer rebuilt
    from the metadata, as the engine does); ``UnsupportedTokenizer`` if tiktoken can't.

    Opening a GGUF file takes seconds (its reader parses the whole vocabulary): call this once
    per file, at start-up, not on the event loop."""
    return _tiktoken_counter(load_tokenizer(path), Path(path).name)


def exact_counter(path: str | Path) -> CheckpointTokenCounter | TokenizerCounter:
    """``from_checkpoint``'s counter, or a ``TokenizerCounter`` where tiktoken can't (the
    tokenizer is loaded once either way)."""
    tokenizer = load_tokenizer(path)
    try:
        return _tiktoken_counter(tokenizer, Path(path).name)
    except UnsupportedTokenizer as exc:
        logger.info("%s: %s; counting with its own tokenizer", path, exc)
        return TokenizerCounter(tokenizer)
