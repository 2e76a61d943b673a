"""A request's prompt tokens, as the engine of each model that may serve it will count them.

`count_prompt_tokens` is the number a budget reservation is made of. A prompt longer than
``limit`` tokens by its (rendered) length alone is not tokenized: the answer is then a lower
bound above ``limit``, enough to refuse it. `PromptCounts` runs each tokenizer at most once
per request (models sharing a checkpoint share a counter fingerprint), on a worker thread for
a long prompt, and keeps the engine's ids where a model's replicas are chosen by prefix (the
replica router hashes them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import anyio
import jinja2

from gateway.admission.token_counter import (
    INLINE_TOKENIZE_CHARS,
    ExactCounter,
    PromptTokens,
    TokenCounter,
)
from gateway.completion_body import CompletionBody
from gateway.errors import ApiError, invalid_request
from gateway.settings import ModelSettings
from model_files.chat_rendering import ChatRenderingError


def count_prompt_tokens(
    counter: TokenCounter, body: CompletionBody, limit: int | None = None
) -> int:
    """The prompt tokens the model's engine will report for ``body``: what is reserved.

    A chat counts its tools too. Chats raise ``ValueError``/``TypeError``/
    ``jinja2.TemplateError`` where the engine's renderer would.
    """
    if body.messages is not None:
        return counter.count_chat(body.messages, limit, tools=body.tools)
    if isinstance(body.prompt, list):
        return len(body.prompt)  # token ids go to the model as they are
    return counter.count_prompt(body.prompt or "", limit)


def tokenize_prompt(counter: TokenCounter, body: CompletionBody, limit: int) -> PromptTokens:
    """`count_prompt_tokens` with the ids, from an exact counter (`ExactCounter`)."""
    if not isinstance(counter, ExactCounter):
        raise TypeError(f"{type(counter).__name__} counts tokens but has no engine ids")
    if body.messages is not None:
        return counter.tokenize_chat(body.messages, limit, tools=body.tools)
    if isinstance(body.prompt, list):
        return PromptTokens(len(body.prompt), body.prompt)
    return counter.tokenize_prompt(body.prompt or "", limit)


class PromptCounts:
    """One request's prompt counted per model, each tokenizer run once (by fingerprint)."""

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
        self._counts: dict[str, PromptTokens] = {}

    async def count(self, model: str) -> int:
        """The prompt's tokens for ``model``, or a lower bound above the limit. Raises a 400
        `ApiError` for messages the model's chat template cannot render."""
        counter = self._counters[model]
        wants_ids = self._models[model].replica_policy == "prefix" and isinstance(
            counter, ExactCounter
        )
        known = self._counts.get(counter.fingerprint)
        if known is None or (wants_ids and known.ids is None and known.count <= self._limit):
            self._counts[counter.fingerprint] = await self._tokenize(counter, wants_ids)
        return self._counts[counter.fingerprint].count

    def ids(self, model: str) -> Sequence[int] | None:
        """The engine's ids `count` kept for ``model``, if it kept any."""
        known = self._counts.get(self._counters[model].fingerprint)
        return known.ids if known is not None else None

    async def _tokenize(self, counter: TokenCounter, wants_ids: bool) -> PromptTokens:
        run = tokenize_prompt if wants_ids else _count_only
        try:
            if self._body.prompt_chars < INLINE_TOKENIZE_CHARS:
                return run(counter, self._body, self._limit)
            return await anyio.to_thread.run_sync(run, counter, self._body, self._limit)
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise _bad_messages(exc) from None


def _count_only(counter: TokenCounter, body: CompletionBody, limit: int) -> PromptTokens:
    return PromptTokens(count_prompt_tokens(counter, body, limit), None)


def _bad_messages(exc: Exception) -> ApiError:
    param = exc.param if isinstance(exc, ChatRenderingError) else "messages"
    return invalid_request(f"The messages cannot be rendered for this model: {exc}", param=param)
