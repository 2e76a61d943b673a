"""Conversations with tools and tool turns, rendered: the default (Hermes) format for a plain
ChatML template, Hugging Face's convention for a template that takes ``tools``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from model_files import tool_call_syntax
from model_files.chat_rendering import ChatRenderingError, tools_section
from model_files.tokenizer import Tokenizer
from tests.support.byte_level_tokenizer import CHATML_TEMPLATE, byte_level_tokenizer

# Qwen2.5's way with tools, shortened: tools in the system turn, calls after the content,
# tool turns under their own role.
TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{{- '\\n<call id=' + call.id + '>' + call.function.name + ' ' + call.function.arguments | tojson }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>tool ' + message.tool_call_id + '\\n' + message.content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city, now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]

# A conversation as a client's raw JSON writes it: content null or in parts, arguments as
# JSON strings (key order "unit" before "city", non-ASCII escaped), two tool answers in a row.
CONVERSATION: list[dict[str, Any]] = [
    {
        "role": "developer",
        "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
    },
    {"role": "user", "content": "Weather and time in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"unit":"c","city":"Z\\u00fcrich"}',
                },
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "09:30"}]},
    {
        "role": "assistant",
        "content": "Checking again.",
        "tool_calls": [
            {
                "id": "call_3",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_3", "content": "09:31"},
]


@pytest.fixture(scope="module")
def chatml() -> Tokenizer:
    return byte_level_tokenizer(CHATML_TEMPLATE)


@pytest.fixture(scope="module")
def with_tools() -> Tokenizer:
    return byte_level_tokenizer(TOOLS_TEMPLATE)


def test_only_a_template_reading_tools_takes_them(chatml: Tokenizer, with_tools: Tokenizer) -> None:
    assert not chatml.template_takes_tools
    assert with_tools.template_takes_tools


def test_a_plain_conversation_renders_as_before(chatml: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    assert chatml.render_chat(messages) == chatml.apply_chat_template(messages)
    assert chatml.render_chat(messages, add_generation_prompt=False) == (
        chatml.apply_chat_template(messages, add_generation_prompt=False)
    )
    ids = chatml.encode_chat(messages)
    assert ids == chatml.encode(chatml.apply_chat_template(messages), add_special_tokens=False)
    assert chatml.decode(ids, skip_special_tokens=False) == chatml.render_chat(messages)


def test_raw_content_and_the_developer_role(chatml: Tokenizer) -> None:
    messages: list[dict[str, Any]] = [
        {
            "role": "developer",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None},
    ]
    assert chatml.render_chat(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nab<|im_end|>\n"
        "<|im_start|>user\nq<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
    )


def test_the_default_format_writes_tools_calls_and_responses(chatml: Tokenizer) -> None:
    expected_section = (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Weather in '
        'a city, now.", "parameters": {"type": "object", "properties": {"city": {"type": '
        '"string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}\n'
        '{"type": "function", "function": {"name": "get_time"}}\n'
        "</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        "<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>"
    )
    assert tools_section(TOOLS) == expected_section
    assert chatml.render_chat(CONVERSATION, tools=TOOLS) == (
        f"<|im_start|>system\nBe brief.\n\n{expected_section}<|im_end|>\n"
        "<|im_start|>user\nWeather and time in Zürich?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "<tool_call>\n"
        '{"name": "get_weather", "arguments": {"unit": "c", "city": "Zürich"}}\n'
        "</tool_call>\n"
        "<tool_call>\n"
        '{"name": "get_time", "arguments": {}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "<tool_response>\n12 C\n</tool_response>\n"
        "<tool_response>\n09:30\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
        "Checking again.\n"
        "<tool_call>\n"
        '{"name": "get_time", "arguments": {}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "<tool_response>\n09:31\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_the_default_format_calls_are_the_syntax_modules(chatml: Tokenizer) -> None:
    """What the prompt shows the model is what the grammar and the parser take."""
    prompt = chatml.render_chat(CONVERSATION, tools=TOOLS)
    written = tool_call_syntax.calls_text(
        [("get_weather", '{"unit": "c", "city": "Zürich"}'), ("get_time", "{}")]
    )
    assert f"<|im_start|>assistant\n{written}<|im_end|>" in prompt
    assert tool_call_syntax.call_instruction() in prompt


def test_without_a_system_turn_the_tools_make_one(chatml: Tokenizer) -> None:
    prompt = chatml.render_chat([{"role": "user", "content": "Hi"}], tools=[TIME])
    assert prompt == (
        f"<|im_start|>system\n{tools_section([TIME])}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chatml.render_chat([{"role": "user", "content": "Hi"}], tools=[]) == (
        chatml.render_chat([{"role": "user", "content": "Hi"}])
    )


def test_tool_turns_render_without_tools_too(chatml: Tokenizer) -> None:
    """A conversation that ends its tool use still shows the calls it made."""
    prompt = chatml.render_chat(CONVERSATION[1:4])
    assert prompt.startswith("<|im_start|>user\nWeather")
    assert "<tools>" not in prompt
    assert "<|im_start|>user\n<tool_response>\n12 C\n</tool_response><|im_end|>\n" in prompt


def test_encode_chat_takes_tools(chatml: Tokenizer) -> None:
    ids = chatml.encode_chat(CONVERSATION, tools=TOOLS)
    assert ids == chatml.encode(chatml.render_chat(CONVERSATION, TOOLS), add_special_tokens=False)
    assert chatml.backend.token_to_id("<|im_start|>") in ids


def test_a_template_that_takes_tools_gets_them_and_parsed_arguments(with_tools: Tokenizer) -> None:
    assert with_tools.render_chat(CONVERSATION[:4], tools=[WEATHER]) == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n"
        + json.dumps(WEATHER, ensure_ascii=False)
        + "\n</tools><|im_end|>\n"
        "<|im_start|>user\nWeather and time in Zürich?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<call id=call_1>get_weather {"unit": "c", "city": "Zürich"}\n'
        "<call id=call_2>get_time {}<|im_end|>\n"
        "<|im_start|>tool call_1\n12 C<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.referee
def test_a_template_that_takes_tools_renders_as_transformers(with_tools: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=with_tools.backend, eos_token="<|im_end|>"
    )
    hf.chat_template = TOOLS_TEMPLATE
    # The conversation in Hugging Face's convention, by hand: arguments as objects.
    hf_messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time in Zürich?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": {"unit": "c", "city": "Zürich"},
                    },
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": {}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "09:30"},
        {
            "role": "assistant",
            "content": "Checking again.",
            "tool_calls": [
                {
                    "id": "call_3",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": {}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_3", "content": "09:31"},
    ]
    for tools in (TOOLS, None):
        for add_generation_prompt in (True, False):
            expected = hf.apply_chat_template(
                hf_messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
            assert with_tools.render_chat(CONVERSATION, tools, add_generation_prompt) == expected


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}],
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]},
            "messages[1].tool_calls[0].function",
        ),
        ({"role": "assistant", "tool_calls": "f()"}, "messages[1].tool_calls"),
        ({"role": "user", "content": 7}, "messages[1].content"),
        ({"role": "user", "content": [{"type": "image_url"}]}, "messages[1].content[0]"),
        ({"role": None, "content": "x"}, "messages[1].role"),
    ],
)
@pytest.mark.parametrize("template", [CHATML_TEMPLATE, TOOLS_TEMPLATE])
def test_an_unreadable_message_is_named(message: dict[str, Any], param: str, template: str) -> None:
    tokenizer = byte_level_tokenizer(template)
    with pytest.raises(ChatRenderingError, match=r"messages\[1\]") as raised:
        tokenizer.render_chat([{"role": "user", "content": "Hi"}, message], tools=[TIME])
    assert raised.value.param == param
    assert isinstance(raised.value, ValueError)
