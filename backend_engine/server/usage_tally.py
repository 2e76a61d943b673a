"""An answer's ``usage``, as OpenAI counts it over several prompts and choices.

Each prompt's tokens count once, however many choices it has (they share its prefill), and
so do its cached tokens; every choice's completion tokens count. The engine's deltas carry
running totals per choice, so the tally keeps the latest of each.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from backend_engine.server.choice_streams import ChoiceDelta


class UsageTally:
    def __init__(self) -> None:
        self._prompt_tokens: dict[int, int] = {}  # by prompt index
        self._cached_tokens: dict[int, int] = {}  # by prompt index; absent: not known yet
        self._completion_tokens: dict[int, int] = {}  # by choice index

    @classmethod
    def of(cls, choices: Iterable[ChoiceDelta]) -> UsageTally:
        tally = cls()
        for choice in choices:
            tally.add(choice)
        return tally

    def add(self, choice: ChoiceDelta) -> None:
        delta = choice.delta
        self._prompt_tokens[choice.prompt_index] = delta.num_prompt_tokens
        if delta.num_cached_tokens is not None:
            self._cached_tokens[choice.prompt_index] = delta.num_cached_tokens
        self._completion_tokens[choice.index] = delta.num_completion_tokens

    @property
    def is_empty(self) -> bool:
        return not self._prompt_tokens

    def usage(self) -> dict[str, Any]:
        """The wire's ``usage`` (cached tokens never known are reported as 0)."""
        prompt_tokens = sum(self._prompt_tokens.values())
        completion_tokens = sum(self._completion_tokens.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self._cached_tokens.values())},
        }
