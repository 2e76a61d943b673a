"""One request's prompt counted per model: each tokenizer runs once, a long prompt off the
event loop, and a chat a template cannot render is the client's 400. (That the count is the
engine's is ``test_prompt_tokens_match_engine.py``.)"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.admission.prompt_tokens import PromptCounts, PromptSizes, count_prompts
from gateway.admission.token_counter import INLINE_TOKENIZE_CHARS, TokenCounter, from_checkpoint
from gateway.completion_body import CompletionBody
from gateway.errors import ApiError
from gateway.settings import ModelSettings


class RecordingCounter:
    """Counts every chat as 7 tokens, recording on which thread each run was."""

    def __init__(self, fingerprint: str, error: Exception | None = None) -> None:
        self.fingerprint = fingerprint
        self.error = error
        self.threads: list[threading.Thread] = []

    def count_text(self, text: str) -> int:
        return 7

    def count_prompt(self, prompt: str, limit: int | None = None) -> int:
        return 7

    def count_chat(self, messages: Any, limit: int | None = None, tools: Any = None) -> int:
        self.threads.append(threading.current_thread())
        if self.error is not None:
            raise self.error
        return 7


def counts(counters: dict[str, TokenCounter], text: str = "hi") -> PromptCounts:
    models = {name: ModelSettings(name, ("http://127.0.0.1:1",), 4096) for name in counters}
    messages = [{"role": "user", "content": text}]
    body = CompletionBody("chat", {}, "m", messages, None, None, False, False)
    return PromptCounts(counters, models, body, limit=4000)


async def test_models_sharing_a_tokenizer_count_the_prompt_once() -> None:
    shared, other = RecordingCounter("shared"), RecordingCounter("other")
    prompt = counts({"a": shared, "b": shared, "c": other})
    assert [(await prompt.count(m)).total for m in ("a", "b", "c", "a")] == [7, 7, 7, 7]
    assert (len(shared.threads), len(other.threads)) == (1, 1)
    assert prompt.ids("a") is None  # an estimating counter keeps no engine ids


async def test_a_long_prompt_is_counted_off_the_event_loop() -> None:
    short, long = RecordingCounter("short"), RecordingCounter("long")
    await counts({"m": short}).count("m")
    await counts({"m": long}, text="x" * INLINE_TOKENIZE_CHARS).count("m")
    assert short.threads == [threading.main_thread()]
    assert long.threads[0] is not threading.main_thread()


async def test_messages_a_template_cannot_render_are_a_400() -> None:
    broken = RecordingCounter("broken", error=ValueError("no such role"))
    with pytest.raises(ApiError) as caught:
        await counts({"m": broken}).count("m")
    assert (caught.value.rejection.status, caught.value.rejection.param) == (400, "messages")


async def test_a_tool_call_the_renderer_cannot_read_is_a_400_naming_it(
    demo_model_files: Callable[..., Path],
) -> None:
    """The engine's renderer (``model_files.chat_rendering``) names the field; so does the 400."""
    counter = from_checkpoint(demo_model_files(architecture="LlamaForCausalLM", size="tiny"))
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    body = CompletionBody("chat", {}, "m", messages, None, None, False, False)
    models = {"m": ModelSettings("m", ("http://127.0.0.1:1",), 4096)}
    with pytest.raises(ApiError) as caught:
        await PromptCounts({"m": counter}, models, body, limit=4000).count("m")
    rejection = caught.value.rejection
    assert (rejection.status, rejection.param) == (
        400,
        "messages[1].tool_calls[0].function.arguments",
    )
    assert "is not valid JSON" in rejection.message


def completion(*prompts: str | list[int], n: int = 1) -> CompletionBody:
    return CompletionBody("completions", {}, "m", None, prompts, None, False, False, n)


async def test_every_prompt_of_a_list_is_counted_and_the_longest_kept(
    demo_model_files: Callable[..., Path],
) -> None:
    counter = from_checkpoint(demo_model_files(architecture="LlamaForCausalLM", size="tiny"))
    texts = ["Once upon a time", "The sea", "A much longer prompt than the other two are"]
    each = [counter.count_prompt(t) for t in texts]
    body = completion(*texts, [5, 6, 7], n=4)
    sizes = count_prompts(counter, body)
    assert sizes == PromptSizes(total=sum(each) + 3, longest=max(each))
    assert sizes.ids is None  # none asked for
    with_ids = count_prompts(counter, body, wants_ids=True)
    assert with_ids.total == sizes.total
    assert with_ids.ids == counter.encode_prompt(texts[0])  # the first prompt's, for routing
    assert count_prompts(counter, completion([9] * 50, "hi")).longest == 50


async def test_a_prompt_above_the_limit_is_a_lower_bound_whatever_its_place(
    demo_model_files: Callable[..., Path],
) -> None:
    counter = from_checkpoint(demo_model_files(architecture="LlamaForCausalLM", size="tiny"))
    body = completion("short", "x " * 5_000)
    sizes = count_prompts(counter, body, limit=100)
    assert sizes.longest > 100
    assert sizes.total >= sizes.longest + counter.count_prompt("short")


async def test_long_prompt_lists_are_counted_off_the_event_loop() -> None:
    threads: list[threading.Thread] = []

    class Recording(RecordingCounter):
        def count_prompt(self, prompt: str, limit: int | None = None) -> int:
            threads.append(threading.current_thread())
            return len(prompt)

    models = {"m": ModelSettings("m", ("http://127.0.0.1:1",), 4096)}
    half = "x" * (INLINE_TOKENIZE_CHARS // 2 + 1)  # each prompt short, together long
    sizes = await PromptCounts({"m": Recording("r")}, models, completion(half, half), 10**9).count(
        "m"
    )
    assert (sizes.total, sizes.longest) == (2 * len(half), len(half))
    assert len(threads) == 2
    assert all(t is not threading.main_thread() for t in threads)
