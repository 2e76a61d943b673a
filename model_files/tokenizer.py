"""The engine's tokenizer: a Hugging Face ``tokenizer.json`` plus its chat template.

Reads what a Hugging Face checkpoint directory ships (``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json``, optionally ``chat_template.jinja``) with
the ``tokenizers`` library and ``jinja2`` only; ``transformers`` is never imported. A GGUF
file's tokenizer is rebuilt from its metadata by ``gguf_tokenizer.py`` into the same class;
``checkpoint.load_tokenizer`` takes either.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from model_files.chat_rendering import template_chat

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class _GenerationTag(Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (HF's assistant mask) as plain body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's own class attribute)

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _template_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers renders it in."""
    return _template_environment().from_string(source)


def template_variables(source: str) -> frozenset[str]:
    """The variables a chat template reads from its caller (``messages``, ``tools``, ...),
    found from its syntax tree."""
    env = _template_environment()
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path.name} in {path.parent} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} in {path.parent} must hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, dict) else None
    return content if isinstance(content, str) else None


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


class Tokenizer:
    """Text ⇄ token ids, special tokens and chat formatting for one checkpoint."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        source: str = "<memory>",
    ) -> None:
        self._backend = backend
        self._source = source
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        self.pad_token_id: int | None = backend.token_to_id(pad_token) if pad_token else None
        eos_ids = set(eos_token_ids)
        if not eos_ids and eos_token and (eos_id := backend.token_to_id(eos_token)) is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self._special_ids = frozenset(
            token_id
            for token_id, token in backend.get_added_tokens_decoder().items()
            if token.special
        )
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        self._template_takes_tools: bool | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face checkpoint directory."""
        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"tokenizer directory {directory} does not exist")
        tokenizer_file = directory / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{TOKENIZER_FILE} not found in {directory}")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception
            raise ValueError(f"cannot read {TOKENIZER_FILE} in {directory}: {exc}") from exc

        config_file = directory / TOKENIZER_CONFIG_FILE
        config = _read_json(config_file) if config_file.is_file() else {}
        generation_file = directory / GENERATION_CONFIG_FILE
        generation = _read_json(generation_file) if generation_file.is_file() else {}

        template_file = directory / CHAT_TEMPLATE_FILE
        chat_template = config.get("chat_template")
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        elif isinstance(chat_template, list):  # named templates: [{"name":..., "template":...}]
            named = {t.get("name"): t.get("template") for t in chat_template}
            chat_template = named.get("default")
        bos_token = _token_content(config.get("bos_token"))
        if bos_token is None and isinstance(generation.get("bos_token_id"), int):
            bos_token = backend.id_to_token(generation["bos_token_id"])
        return cls(
            backend,
            bos_token=bos_token,
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            unk_token=_token_content(config.get("unk_token")),
            eos_token_ids=_as_ids(generation.get("eos_token_id")),
            chat_template=chat_template if isinstance(chat_template, str) else None,
            source=str(directory),
        )

    @property
    def backend(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        tokens = []
        for token_id in ids:
            token = self._backend.id_to_token(token_id)
            if token is None:
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary ({self.vocab_size})"
                )
            tokens.append(token)
        return tokens

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` to the prompt string, exactly as transformers does.

        Extra keyword arguments (``tools``, ``documents``, ...) are passed to the template.
        """
        if self.chat_template is None:
            if self._source.lower().endswith(".gguf"):
                raise ValueError(f"no chat template: {self._source} has no tokenizer.chat_template")
            raise ValueError(
                f"no chat template: neither {TOKENIZER_CONFIG_FILE} nor {CHAT_TEMPLATE_FILE} "
                f"in {self._source} defines one"
            )
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self.chat_template)
        special = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
        }
        variables = {k: v for k, v in special.items() if v is not None}
        variables.update(template_kwargs)
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template reads a ``tools`` variable (computed once)."""
        if self._template_takes_tools is None:
            self._template_takes_tools = self.chat_template is not None and (
                "tools" in template_variables(self.chat_template)
            )
        return self._template_takes_tools

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt for a conversation given as OpenAI's JSON, tools and tool turns included.

        ``messages`` may come raw from a client (content as text parts or null);
        ``model_files.chat_rendering`` says how they and ``tools`` reach the template. Raises
        ``chat_rendering.ChatRenderingError`` (a ``ValueError``) for a message it cannot read.
        """
        chat = template_chat(messages, tools, template_takes_tools=self.template_takes_tools)
        return self.apply_chat_template(chat.messages, add_generation_prompt, **chat.variables)

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Prompt token ids for ``messages`` (and ``tools``), as ``render_chat`` renders them.

        The template writes the bos token itself when the model wants one, so the rendered text
        is encoded without special tokens (no double BOS), as transformers and vLLM do.
        """
        prompt = self.render_chat(messages, tools, add_generation_prompt)
        return self.encode(prompt, add_special_tokens=False)
