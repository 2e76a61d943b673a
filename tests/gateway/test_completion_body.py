"""The parsed completion body: what counting its prompt costs, before the counters run."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.completion_body import CompletionBody


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": [{"type": "x", "text": "w" * 100_000}]}],
        [{"role": "u" * 100_000, "content": "hi"}],
        [{"role": "user", "name": "n" * 100_000, "content": "hi"}],
        [{"role": "user", "content": ""}] * 20_000,
    ],
    ids=["part-of-another-type", "long-role", "long-name", "many-empty-messages"],
)
def test_prompt_chars_bounds_what_counting_a_chat_costs(messages: list[Any]) -> None:
    # The counters render roles, names and every part into their templates: a chat that is
    # large anywhere must be counted off the event loop, so its size must show here.
    body = CompletionBody("chat", {}, "m", messages, None, None, False, False)
    assert body.prompt_chars >= 100_000


def test_num_choices_is_n_for_each_prompt() -> None:
    chat = CompletionBody(
        "chat", {}, "m", [{"role": "user", "content": "hi"}], None, 8, False, False
    )
    assert chat.num_choices == 1
    assert CompletionBody("chat", {}, "m", [], None, 8, False, False, n=5).num_choices == 5
    prompts = ("a", [1, 2], "c")
    listed = CompletionBody("completions", {}, "m", None, prompts, 8, False, False, n=4)
    assert listed.num_choices == 12
