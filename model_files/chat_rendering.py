"""A conversation with tools and tool turns, made into what a chat template renders.

``messages`` are OpenAI's JSON message objects as a client sends them (the gateway's token
counter passes them raw; the engine passes ``ChatMessage.template_dict()``, the same shape).
:func:`template_chat` turns them into the template's messages and variables;
``Tokenizer.render_chat`` renders that. The rules:

- **Content**: a string, a list of ``{"type": "text", "text": ...}`` parts (joined), or null
  (``""``). Anything else is a :class:`ChatRenderingError` naming the message.
- **Roles**: ``developer`` is rendered as ``system``; the others go to the template as they are.
- **A template that takes tools** (one whose source reads a ``tools`` variable, found from its
  syntax tree: ``Tokenizer.template_takes_tools``) gets ``tools`` (OpenAI's list of
  ``{"type": "function", "function": {...}}``, or None) and the tool turns as Hugging Face's
  templates expect them: an assistant's ``tool_calls`` with each ``function.arguments`` parsed
  from its JSON string into the object, a ``tool`` turn with its ``content`` and
  ``tool_call_id``. Its own format is then the model's.
- **Any other template** (SmolLM2's is plain ChatML) gets one default format, Hermes' (the one
  Qwen2.5's, Hermes' and SmolLM3's templates write), in plain turns:

  - with tools, a tools section (:func:`tools_section`) is appended to the leading system turn
    after a blank line, or is a new system turn first. It lists each tool's JSON inside
    ``<tools></tools>`` and asks for each call as ``model_files.tool_call_syntax`` writes it;
  - an assistant turn with ``tool_calls`` is its content, if any, then a newline and its calls,
    ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` joined by newlines, the
    arguments re-serialized by ``json.dumps`` of the parsed object (key order kept) in the
    syntax's separators: exactly what the tool grammar lets the model write;
  - a ``tool`` turn becomes a ``user`` turn whose content is
    ``<tool_response>\\n{content}\\n</tool_response>``; consecutive tool turns are merged into
    one user turn, their responses joined by a newline.

An assistant call's ``function.arguments`` must be JSON text (OpenAI's shape; an object
already parsed is taken too): invalid JSON is a :class:`ChatRenderingError`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from model_files import tool_call_syntax

TOOLS_OPEN = "<tools>"
TOOLS_CLOSE = "</tools>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"


class ChatRenderingError(ValueError):
    """A conversation the prompt cannot be built from: the client's mistake (a 400).

    ``param`` names the offending field, as OpenAI's error body does
    (``messages[2].tool_calls[0].function.arguments``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class TemplateChat:
    """What a chat template renders: its ``messages`` and extra ``variables`` (``tools``)."""

    messages: list[dict[str, Any]]
    variables: dict[str, Any]


def template_chat(
    messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    template_takes_tools: bool,
) -> TemplateChat:
    """The template's view of ``messages`` and ``tools`` (see the module's rules)."""
    tools = tools or None
    if template_takes_tools:
        return TemplateChat(
            [_template_message(n, m) for n, m in enumerate(messages)], {"tools": tools}
        )
    return TemplateChat(_default_format_messages(messages, tools), {})


def message_text(content: Any, param: str) -> str:
    """A message's content as one string: text parts joined, null as ``""``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for n, part in enumerate(content):
            text = part.get("text") if isinstance(part, dict) else None
            if not isinstance(text, str):
                raise ChatRenderingError(f"{param}[{n}] is not a text part", f"{param}[{n}]")
            texts.append(text)
        return "".join(texts)
    raise ChatRenderingError(f"{param} must be a string, a list of text parts or null", param)


def tools_section(tools: list[dict[str, Any]]) -> str:
    """The default format's instructions and function signatures, for a system turn."""
    signatures = "\n".join(tool_call_syntax.json_text(tool) for tool in tools)
    opening = tool_call_syntax.CALL_OPEN
    closing = tool_call_syntax.CALL_CLOSE
    return (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within {TOOLS_OPEN}{TOOLS_CLOSE} "
        "XML tags:\n"
        f"{TOOLS_OPEN}\n{signatures}\n{TOOLS_CLOSE}\n\n"
        "For each function call, return a json object with function name and arguments "
        f"within {opening}{closing} XML tags:\n"
        f"{tool_call_syntax.call_instruction()}"
    )


@dataclass(frozen=True)
class _Call:
    id: str | None
    name: str
    arguments: Any  # the parsed JSON value


def _role(message: dict[str, Any], param: str) -> str:
    role = message.get("role")
    if not isinstance(role, str):
        raise ChatRenderingError(f"{param}.role must be a string", f"{param}.role")
    return "system" if role == "developer" else role


def _calls(message: dict[str, Any], param: str) -> list[_Call]:
    raw = message.get("tool_calls")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ChatRenderingError(f"{param}.tool_calls must be a list", f"{param}.tool_calls")
    return [_call(call, f"{param}.tool_calls[{n}]") for n, call in enumerate(raw)]


def _call(raw: Any, param: str) -> _Call:
    function = raw.get("function") if isinstance(raw, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(function, dict) or not isinstance(name, str):
        raise ChatRenderingError(
            f"{param} must be a function call with a name", f"{param}.function"
        )
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ChatRenderingError(
                f"{param}.function.arguments is not valid JSON: {exc}",
                f"{param}.function.arguments",
            ) from exc
    call_id = raw.get("id")
    return _Call(call_id if isinstance(call_id, str) else None, name, arguments)


def _template_message(n: int, message: dict[str, Any]) -> dict[str, Any]:
    """One turn in Hugging Face's convention, for a template that takes tools."""
    param = f"messages[{n}]"
    out: dict[str, Any] = {
        "role": _role(message, param),
        "content": message_text(message.get("content"), f"{param}.content"),
    }
    if calls := _calls(message, param):
        out["tool_calls"] = [
            {
                **({"id": call.id} if call.id is not None else {}),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in calls
        ]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _default_format_messages(
    messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Plain ``{"role", "content"}`` turns in the default (Hermes) format."""
    out: list[dict[str, Any]] = []
    previous_role: str | None = None
    for n, message in enumerate(messages):
        param = f"messages[{n}]"
        role = _role(message, param)
        text = message_text(message.get("content"), f"{param}.content")
        if role == "tool":
            response = f"{RESPONSE_OPEN}\n{text}\n{RESPONSE_CLOSE}"
            if previous_role == "tool":
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
        elif calls := _calls(message, param):
            written = tool_call_syntax.calls_text(
                [(call.name, tool_call_syntax.json_text(call.arguments)) for call in calls]
            )
            out.append({"role": role, "content": f"{text}\n{written}" if text else written})
        else:
            turn = {"role": role, "content": text}
            if isinstance(message.get("name"), str):
                turn["name"] = message["name"]
            out.append(turn)
        previous_role = role
    if tools:
        section = tools_section(tools)
        if out and out[0]["role"] == "system":
            system_text = out[0]["content"]
            out[0]["content"] = f"{system_text}\n\n{section}" if system_text else section
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
