"""A request's prompt tokens, as the engine of each model that may serve it will count them.

A chat has one prompt; a completion may have several (a list of prompts, one choice each
times ``n``). `count_prompts` counts each of them: their sum (`PromptSizes.total`) is what
the engine's usage reports and what a budget reservation is made of, the longest
(`PromptSizes.longest`) is what the context window and the tenant's ``max_prompt_tokens``
bound. A prompt longer than ``limit`` tokens by its (rendered) length alone is not tokenized:
its count is then a lower bound above ``limit``, enough to refuse it. `PromptCounts` runs
each tokenizer at most once per request (models sharing a checkpoint share a counter
fingerprint), on a worker thread for long prompts, and keeps the engine's ids of the first
prompt where a model's replicas are chosen by prefix (the replica router hashes them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import anyio
import jinja2

from gateway.admission.token_counter import (
    INLINE_TOKENIZE_CHARS,
    ExactCounter,
    PromptTokens,
    TokenCounter,
)
from gateway.completion_body import CompletionBody, Prompt
from gateway.errors import ApiError, invalid_request
from gateway.settings import ModelSettings
from model_files.chat_rendering import ChatRenderingError


@dataclass(frozen=True)
class PromptSizes:
    """A request's prompts as one model's engine counts them."""

    total: int  # every prompt's tokens, each prompt once (however many choices it has)
    longest: int  # the longest prompt's tokens (a lower bound above the limit: untokenized)
    ids: Sequence[int] | None = field(default=None, repr=False)  # the first prompt's ids


def count_prompts(
    counter: TokenCounter,
    body: CompletionBody,
    limit: int | None = None,
    *,
    wants_ids: bool = False,
) -> PromptSizes:
    """Each prompt of ``body`` as the model's engine will count it; with ``wants_ids`` (an
    exact counter, `ExactCounter`) the first prompt's engine ids too, where it was tokenized.

    A chat counts its tools too. Chats raise ``ValueError``/``TypeError``/
    ``jinja2.TemplateError`` where the engine's renderer would.
    """
    if wants_ids and not isinstance(counter, ExactCounter):
        raise TypeError(f"{type(counter).__name__} counts tokens but has no engine ids")
    if body.messages is not None:
        if isinstance(counter, ExactCounter) and wants_ids:
            chat = counter.tokenize_chat(body.messages, limit, tools=body.tools)
        else:
            chat = PromptTokens(counter.count_chat(body.messages, limit, tools=body.tools), None)
        return PromptSizes(chat.count, chat.count, chat.ids)
    counts = [_count_prompt(counter, p, limit, wants_ids) for p in body.prompts or ("",)]
    sizes = [c.count for c in counts]
    return PromptSizes(sum(sizes), max(sizes), counts[0].ids)


def count_prompt_tokens(
    counter: TokenCounter, body: CompletionBody, limit: int | None = None
) -> int:
    """The prompt tokens the model's engine will report for ``body`` (every prompt): what is
    reserved for them."""
    return count_prompts(counter, body, limit).total


def _count_prompt(
    counter: TokenCounter, prompt: Prompt, limit: int | None, wants_ids: bool
) -> PromptTokens:
    if isinstance(prompt, list):  # token ids go to the model as they are
        return PromptTokens(len(prompt), prompt if wants_ids else None)
    if isinstance(counter, ExactCounter) and wants_ids:
        return counter.tokenize_prompt(prompt, limit)
    return PromptTokens(counter.count_prompt(prompt, limit), None)


class PromptCounts:
    """One request's prompts counted per model, each tokenizer run once (by fingerprint)."""

    def __init__(
        self,
        counters: Mapping[str, TokenCounter],
        models: Mapping[str, ModelSettings],
        body: CompletionBody,
        limit: int,
    ) -> None:
        self._counters = counters
        self._models = models
        self._body = body
        self._limit = limit
        self._counts: dict[str, PromptSizes] = {}

    async def count(self, model: str) -> PromptSizes:
        """The prompts' tokens for ``model`` (a lower bound above the limit for a prompt too
        long to tokenize). Raises a 400 `ApiError` for messages the model's chat template
        cannot render."""
        counter = self._counters[model]
        wants_ids = self._models[model].replica_policy == "prefix" and isinstance(
            counter, ExactCounter
        )
        known = self._counts.get(counter.fingerprint)
        if known is None or (wants_ids and known.ids is None and known.longest <= self._limit):
            self._counts[counter.fingerprint] = await self._tokenize(counter, wants_ids)
        return self._counts[counter.fingerprint]

    def ids(self, model: str) -> Sequence[int] | None:
        """The engine's ids (of the first prompt) `count` kept for ``model``, if it kept any."""
        known = self._counts.get(self._counters[model].fingerprint)
        return known.ids if known is not None else None

    async def _tokenize(self, counter: TokenCounter, wants_ids: bool) -> PromptSizes:
        body, limit = self._body, self._limit
        try:
            if body.prompt_chars < INLINE_TOKENIZE_CHARS:
                return count_prompts(counter, body, limit, wants_ids=wants_ids)
            return await anyio.to_thread.run_sync(
                lambda: count_prompts(counter, body, limit, wants_ids=wants_ids)
            )
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise _bad_messages(exc) from None


def _bad_messages(exc: Exception) -> ApiError:
    param = exc.param if isinstance(exc, ChatRenderingError) else "messages"
    return invalid_request(f"The messages cannot be rendered for this model: {exc}", param=param)
