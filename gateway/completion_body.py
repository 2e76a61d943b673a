"""`CompletionBody`: one validated completion request, as admission and the request path read it.

`gateway.api.request_body` reads and validates the client's JSON into one; admission counts
its prompts and asks the policies about it; the request path forwards its ``raw`` object.

A chat has one prompt (its messages); a completion has one or more (``prompt`` as a string or
token ids, or a list of them). Each prompt gets ``n`` choices: `num_choices` is what the
budget reserves ``max_tokens`` for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

from openai_protocol.field_rules import Endpoint
from policies.model_routing import ModelSize

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]]
Prompt = str | list[int]  # one completion prompt: text, or the token ids it is made of


ROUTING_HINTS: tuple[ModelSize, ...] = get_args(ModelSize)  # `tollway_hint`'s values


@dataclass(frozen=True)
class CompletionBody:
    """One validated request. ``raw`` is the client's JSON object (less its nulls),
    forwarded nearly as is."""

    endpoint: Endpoint
    raw: dict[str, Any]
    model: str
    messages: Messages | None  # chat
    prompts: tuple[Prompt, ...] | None  # completions: each prompt of the request, in order
    max_tokens: int | None
    is_stream: bool
    include_usage: bool
    n: int = 1  # choices per prompt

    @property
    def num_choices(self) -> int:
        """How many answers the request asks for: ``n`` for each of its prompts."""
        num_prompts = len(self.prompts) if self.prompts is not None else 1
        return self.n * max(num_prompts, 1)

    @property
    def prompt_text(self) -> str:
        """The user-visible text, for routing heuristics (never logged)."""
        if self.messages is not None:
            return "\n".join(_content_text(m.get("content")) for m in self.messages)
        return "\n".join(p for p in self.prompts or () if isinstance(p, str))

    @property
    def tools(self) -> Tools | None:
        """A chat's ``tools`` (OpenAI's JSON, as the field rules passed them), or None for
        none: the template renders them into the prompt."""
        tools = self.raw.get("tools") if self.messages is not None else None
        return tools if isinstance(tools, list) and tools else None

    @property
    def user(self) -> str | None:
        """OpenAI's end-user id, if the request names one (its rollout versions stick to it)."""
        user = self.raw.get("user")
        return user if isinstance(user, str) and user else None

    @property
    def routing_hint(self) -> ModelSize | None:
        """``tollway_hint`` (on a routing alias, which of its pair to use), when it is one of
        `ROUTING_HINTS`: `parse_body` refuses any other value."""
        hint = self.raw.get("tollway_hint")
        return next((size for size in ROUTING_HINTS if size == hint), None)

    @property
    def num_turns(self) -> int:
        return len(self.messages) if self.messages is not None else 1

    @property
    def prompt_chars(self) -> int:
        """What counting the prompts' tokens costs, in characters (0 for token ids): for a
        chat every string of every message (roles, names, parts of any type, tool calls: the
        counters render and tokenize them all) and of the tools, plus a little for each
        message and value."""
        if self.messages is not None:
            return _size_in_chars(self.messages) + _size_in_chars(self.tools or [])
        return sum(len(p) for p in self.prompts or () if isinstance(p, str))


_VALUE_CHARS = 8  # what a template or a JSON rendering adds around each value


def _size_in_chars(value: Any) -> int:
    """The characters of every string in ``value`` and its keys, plus ``_VALUE_CHARS`` each
    value (nesting is bounded by the body's depth cap)."""
    if isinstance(value, str):
        return len(value) + _VALUE_CHARS
    if isinstance(value, dict):
        return _VALUE_CHARS + sum(len(str(k)) + _size_in_chars(v) for k, v in value.items())
    if isinstance(value, list):
        return _VALUE_CHARS + sum(_size_in_chars(v) for v in value)
    return _VALUE_CHARS


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""
