"""The tool-call grammar, run by llguidance over SmolLM2's tokenizer: the calls the syntax
module writes are accepted, wrong names, bad arguments, stray text and extra calls are not,
and EOS is allowed only where the answer may end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backend_engine.structured_output.tool_grammar import (
    NO_PARAMETERS,
    tool_call_constraint,
    tool_call_grammar,
)
from model_files import tool_call_syntax as syntax
from model_files.checkpoint import load_tokenizer
from model_files.tokenizer import Tokenizer

llguidance = pytest.importorskip("llguidance")

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]

PARIS = syntax.call_text("get_weather", '{"city": "Paris"}')
ZURICH = syntax.call_text("get_weather", '{"city": "Zürich", "unit": "celsius", "days": 3}')
NOW = syntax.call_text("get_time", "{}")


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return load_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def lltokenizer(tokenizer: Tokenizer) -> Any:
    [eos] = tokenizer.eos_token_ids
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=eos)


class Run:
    """One grammar, fed one text's tokens at a time."""

    def __init__(self, tokenizer: Tokenizer, lltokenizer: Any, grammar: str) -> None:
        self.tokenizer = tokenizer
        self.lltokenizer = lltokenizer
        self.grammar = grammar
        matcher = llguidance.LLMatcher(lltokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()

    def eos_allowed_after(self, text: str) -> list[bool] | None:
        """For each prefix of ``text``'s tokens (empty to whole): whether EOS may come next;
        None when the grammar refuses a token of ``text``."""
        matcher = llguidance.LLMatcher(self.lltokenizer, self.grammar)
        allowed = [self._is_eos_allowed(matcher)]
        for token_id in self.tokenizer.encode(text, add_special_tokens=False):
            if not matcher.consume_token(token_id):
                return None
            allowed.append(self._is_eos_allowed(matcher))
        return allowed

    def _is_eos_allowed(self, matcher: Any) -> bool:
        """EOS's bit in the next token's mask (what the sampler is held to)."""
        eos = self.lltokenizer.eos_token
        return bool(matcher.compute_bitmask()[eos // 8] >> (eos % 8) & 1)

    def accepts(self, text: str) -> bool:
        """``text`` whole, then EOS."""
        allowed = self.eos_allowed_after(text)
        return allowed is not None and allowed[-1]

    def is_refused(self, text: str) -> bool:
        """Some token of ``text`` is refused (not only the EOS after it)."""
        return self.eos_allowed_after(text) is None


def grammar_run(
    tokenizer: Tokenizer,
    lltokenizer: Any,
    tool_choice: str | dict[str, Any],
    parallel_tool_calls: bool = True,
    tools: list[dict[str, Any]] = TOOLS,
) -> Run:
    return Run(tokenizer, lltokenizer, tool_call_grammar(tools, tool_choice, parallel_tool_calls))


def test_the_constraint_is_a_grammar_from_tools() -> None:
    constraint = tool_call_constraint(TOOLS, "required", True)
    assert constraint is not None
    assert (constraint.kind, constraint.param) == ("grammar", "tools")
    assert constraint.source == tool_call_grammar(TOOLS, "required", True)
    assert tool_call_constraint(TOOLS, "none", True) is None


def test_required_takes_one_or_more_calls(tokenizer: Tokenizer, lltokenizer: Any) -> None:
    run = grammar_run(tokenizer, lltokenizer, "required")
    for calls in ([PARIS], [ZURICH], [NOW], [PARIS, NOW], [NOW, ZURICH, PARIS]):
        assert run.accepts(syntax.CALL_SEPARATOR.join(calls)), calls


def test_required_refuses_text_names_and_arguments_outside_the_tools(
    tokenizer: Tokenizer, lltokenizer: Any
) -> None:
    run = grammar_run(tokenizer, lltokenizer, "required")
    refused = [
        "Sure, let me look.",
        "Sure.\n" + PARIS,
        syntax.call_text("get_wether", '{"city": "Paris"}'),
        syntax.call_text("get_weather", '{"town": "Paris"}'),  # no such property
        syntax.call_text("get_weather", '{"city": 7}'),  # not a string
        syntax.call_text("get_weather", '{"city": "Paris", "unit": "kelvin"}'),
        syntax.call_text("get_weather", '{"city": "Paris", "days": 0}'),  # below the minimum
        syntax.call_text("get_weather", '{"city":"Paris"}'),  # the separators are the syntax's
        syntax.call_text("get_weather", '{"city": "Paris",  "days": 2}'),
        syntax.call_text("get_time", '{"now": true}'),  # no parameters: exactly {}
        PARIS.replace("<tool_call>\n", "<tool_call>"),
        PARIS + " and more",
        PARIS + "\n\n" + NOW,
    ]
    for text in refused:
        assert run.is_refused(text), text
    # Arguments that stop short of their required property never close.
    assert not run.accepts(syntax.call_text("get_weather", "{}"))


def test_eos_comes_only_after_a_whole_call(tokenizer: Tokenizer, lltokenizer: Any) -> None:
    run = grammar_run(tokenizer, lltokenizer, "required")
    two_calls = PARIS + syntax.CALL_SEPARATOR + NOW
    allowed = run.eos_allowed_after(two_calls)
    assert allowed is not None
    ends = [len(tokenizer.encode(text, add_special_tokens=False)) for text in (PARIS, two_calls)]
    assert [n for n, is_allowed in enumerate(allowed) if is_allowed] == ends


def test_without_parallel_calls_a_second_call_is_refused(
    tokenizer: Tokenizer, lltokenizer: Any
) -> None:
    run = grammar_run(tokenizer, lltokenizer, "required", parallel_tool_calls=False)
    assert run.accepts(PARIS)
    assert run.accepts(NOW)
    assert run.is_refused(PARIS + syntax.CALL_SEPARATOR)
    assert run.is_refused(PARIS + syntax.CALL_SEPARATOR + NOW)


def test_a_named_function_is_called_once(tokenizer: Tokenizer, lltokenizer: Any) -> None:
    run = grammar_run(
        tokenizer, lltokenizer, {"type": "function", "function": {"name": "get_time"}}
    )
    assert run.accepts(NOW)
    assert run.is_refused(PARIS)
    assert run.is_refused(NOW + syntax.CALL_SEPARATOR + NOW)
    assert run.is_refused("The time is")
    with pytest.raises(ValueError, match="'get_date', which is not in 'tools'"):
        tool_call_grammar(TOOLS, {"type": "function", "function": {"name": "get_date"}}, True)


def test_auto_takes_plain_text_anywhere_it_may_end(tokenizer: Tokenizer, lltokenizer: Any) -> None:
    run = grammar_run(tokenizer, lltokenizer, "auto")
    for text in ("", "It is sunny.", "Tags like <tool_response> or <tool_call are fine\n"):
        allowed = run.eos_allowed_after(text)
        assert allowed is not None, text
        assert all(allowed), text
    # Byte tokens of one character: EOS waits for the character's last byte.
    assert run.accepts("日本語 🙂")


def test_auto_takes_calls_after_optional_text(tokenizer: Tokenizer, lltokenizer: Any) -> None:
    run = grammar_run(tokenizer, lltokenizer, "auto")
    for text in (
        PARIS,
        "Let me check.\n" + PARIS,
        "Let me check both.\n" + PARIS + syntax.CALL_SEPARATOR + NOW,
        "<tool_response>?\n\n" + ZURICH,
    ):
        assert run.accepts(text), text
    text = "Checking.\n" + PARIS
    allowed = run.eos_allowed_after(text)
    assert allowed is not None
    opening = len(tokenizer.encode("Checking.\n<tool_call>", add_special_tokens=False))
    assert all(allowed[:opening])  # plain text so far
    assert not any(allowed[opening + 1 : -1])  # inside the call
    assert allowed[-1]


def test_auto_holds_what_follows_an_opening_tag_to_a_call(
    tokenizer: Tokenizer, lltokenizer: Any
) -> None:
    run = grammar_run(tokenizer, lltokenizer, "auto")
    for text in (
        "Calling <tool_call> now",
        'x<tool_call>\n{"name": "get_date"',
        syntax.call_text("get_weather", '{"city": 7}'),
        PARIS + " done.",
        PARIS + syntax.CALL_SEPARATOR + "More text",
    ):
        assert run.is_refused(text), text
    single = grammar_run(tokenizer, lltokenizer, "auto", parallel_tool_calls=False)
    assert single.accepts("Hm.\n" + PARIS)
    assert single.is_refused(PARIS + syntax.CALL_SEPARATOR + NOW)


def test_names_and_schemas_are_written_into_the_grammar_safely(
    tokenizer: Tokenizer, lltokenizer: Any
) -> None:
    """A name with quotes, backslashes and non-ASCII; a schema with $defs and $ref (resolved
    from the arguments' own root); an empty parameters object takes no arguments."""
    odd_name = 'say "hé\\llo"\x7f'
    tools = [
        {
            "type": "function",
            "function": {
                "name": odd_name,
                "parameters": {
                    "$defs": {"word": {"type": "string", "pattern": "^[a-z]+$"}},
                    "properties": {"words": {"type": "array", "items": {"$ref": "#/$defs/word"}}},
                    "required": ["words"],
                },
            },
        },
        {"type": "function", "function": {"name": "nothing", "parameters": {}}},
    ]
    run = grammar_run(tokenizer, lltokenizer, "required", tools=tools)
    assert run.accepts(syntax.call_text(odd_name, '{"words": ["ab", "c"]}'))
    assert run.is_refused(syntax.call_text(odd_name, '{"words": ["Ab"]}'))
    assert run.is_refused(syntax.call_text(odd_name, '["ab"]'))  # an object, made so
    assert run.accepts(syntax.call_text("nothing", "{}"))
    assert run.is_refused(syntax.call_text("nothing", '{"a": 1}'))
    assert NO_PARAMETERS["additionalProperties"] is False


@pytest.mark.parametrize(
    ("tools", "tool_choice", "message"),
    [
        ([], "required", "at least one function"),
        ([{"type": "function"}], "auto", r"tools\[0\] is not a function with a name"),
        (TOOLS, "sometimes", "tool_choice must be"),
    ],
)
def test_unusable_tools_are_a_value_error(
    tools: list[dict[str, Any]], tool_choice: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        tool_call_grammar(tools, tool_choice, True)
