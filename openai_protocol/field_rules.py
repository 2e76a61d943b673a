"""What a completion request's fields may hold: one table, checked by the gateway and the engine.

Both sides call :func:`check_fields` on the parsed JSON object before anything else reads it,
so a value the engine could not execute (``seed=2**64``, ``top_k=10**20``) is a 400 at the
door, never a failed engine step. The module is plain Python (no torch, no pydantic): the
gateway imports it.

- ``null`` means "not given" for every optional field (as OpenAI treats it): the field is
  skipped here and :func:`drop_nulls` removes it before the body goes further.
- Fields the engine does not implement are accepted only with their no-op value
  (``best_of: 1``, ``suffix: ""``, the deprecated ``functions``); any other value is refused
  rather than silently ignored.
- Output constraints and tools have their own modules, gathered into the table here:
  ``schema_rules`` (``response_format``, ``structured_outputs``, and the bounds of every
  JSON Schema a request carries) and ``tool_rules`` (``tools``, ``tool_choice``). Rules across
  fields run after each field passed its own: ``top_logprobs`` needs ``logprobs``, a
  ``tool_choice`` needs ``tools``, and a request takes one output constraint at most.
- Fields not in the table are ignored, as OpenAI's own API ignores them.

Each rule also states itself as JSON Schema keywords (``json_schema``), which the gateway's
OpenAPI document lays over the request models, so the document says what is checked here.

Errors are raised as :class:`FieldError` (message, param, code in OpenAI's words, built in
``field_errors``); the gateway and the engine server each turn it into their own 400.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from openai_protocol.field_errors import FieldError as FieldError
from openai_protocol.field_errors import check_length, check_num_items, invalid_type
from openai_protocol.prompt_rules import MAX_CHOICES, Prompt, check_content_parts, num_prompts
from openai_protocol.schema_rules import ResponseFormat, StructuredOutputs, check_one_constraint
from openai_protocol.tool_rules import ToolChoice, Tools, check_tool_choice

Endpoint = Literal["chat", "completions"]

MAX_INT32 = 2**31 - 1
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1  # OpenAI's: a signed 64-bit integer
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 1024  # each stop string is held back from a stream until decided
MAX_MODEL_CHARS = 200  # the usage record's requested_model column
MAX_USER_CHARS = 256
MAX_JSON_DEPTH = 64
MAX_TOKEN_ID = MAX_INT32
MAX_LOGIT_BIAS_TOKENS = 300  # OpenAI's bounds
MAX_LOGIT_BIAS = 100
MAX_REPETITION_PENALTY = 100.0

_CONTROL_CHARACTERS = re.compile("[\x00-\x1f\x7f-\x9f]")
PRINTABLE_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*$"  # the same, for JSON Schema


def _unsupported_value(param: str, value: Any, default: str) -> FieldError:
    return FieldError(
        f"Unsupported value: '{param}' does not support {value!r} on this server. "
        f"Only the default ({default}) value is supported.",
        param,
        "unsupported_value",
    )


def _out_of_range(param: str, what: str, value: float, low: str | None, high: str | None) -> None:
    if low is not None:
        raise FieldError(
            f"Invalid '{param}': {what} below minimum value. Expected a value {low}, "
            f"but got {value} instead.",
            param,
            f"{what}_below_min_value",
        )
    raise FieldError(
        f"Invalid '{param}': {what} above maximum value. Expected a value {high}, "
        f"but got {value} instead.",
        param,
        f"{what}_above_max_value",
    )


@dataclass(frozen=True)
class Decimal:
    """A JSON number in ``[low, high]`` (``(low, high]`` when ``is_low_open``)."""

    low: float
    high: float
    is_low_open: bool = False
    only: float | None = None  # the one value this server supports, when it does not implement it

    def check(self, param: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid_type(param, "a decimal", value)
        if value < self.low or (self.is_low_open and value == self.low):
            sign = ">" if self.is_low_open else ">="
            _out_of_range(param, "decimal", value, f"{sign} {self.low:g}", None)
        if value > self.high:
            _out_of_range(param, "decimal", value, None, f"<= {self.high:g}")
        if self.only is not None and value != self.only:
            raise _unsupported_value(param, value, f"{self.only:g}")

    def json_schema(self) -> dict[str, Any]:
        low = "exclusiveMinimum" if self.is_low_open else "minimum"
        return {low: self.low, "maximum": self.high}


@dataclass(frozen=True)
class Integer:
    """A JSON integer in ``[low, high]``."""

    low: int
    high: int
    only: int | None = None

    def check(self, param: str, value: Any) -> None:
        # orjson gives integers past 64 bits as floats: report those as out of range.
        is_huge = isinstance(value, float) and not self.low <= value <= self.high
        if is_huge and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid_type(param, "an integer", value)
        if value < self.low:
            _out_of_range(param, "integer", value, f">= {self.low}", None)
        if value > self.high:
            _out_of_range(param, "integer", value, None, f"<= {self.high}")
        if self.only is not None and value != self.only:
            raise _unsupported_value(param, value, str(self.only))

    def json_schema(self) -> dict[str, Any]:
        return {"minimum": self.low, "maximum": self.high}


@dataclass(frozen=True)
class Boolean:
    only: bool | None = None

    def check(self, param: str, value: Any) -> None:
        if not isinstance(value, bool):
            raise invalid_type(param, "a boolean", value)
        if self.only is not None and value != self.only:
            raise _unsupported_value(param, value, str(self.only).lower())

    def json_schema(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class Text:
    """A string of ``min_chars`` to ``max_chars`` characters; ``is_printable``: no control
    characters (it is stored in a usage record, and PostgreSQL refuses NUL)."""

    max_chars: int
    min_chars: int = 0
    is_printable: bool = False

    def check(self, param: str, value: Any) -> None:
        if not isinstance(value, str):
            raise invalid_type(param, "a string", value)
        check_length(param, value, self.min_chars, self.max_chars)
        if self.is_printable and _CONTROL_CHARACTERS.search(value):
            raise FieldError(
                f"Invalid '{param}': control characters (such as NUL) are not allowed.",
                param,
                "invalid_value",
            )

    def json_schema(self) -> dict[str, Any]:
        schema: dict[str, Any] = {"minLength": self.min_chars, "maxLength": self.max_chars}
        if self.is_printable:
            schema["pattern"] = PRINTABLE_PATTERN
        return schema


@dataclass(frozen=True)
class Stop:
    """A string or an array of up to ``MAX_STOP_STRINGS`` non-empty, bounded strings."""

    def check(self, param: str, value: Any) -> None:
        if isinstance(value, str):
            check_length(param, value, 1, MAX_STOP_CHARS)
            return
        if not isinstance(value, list):
            raise invalid_type(param, "a string or an array of strings", value)
        check_num_items(param, value, 0, MAX_STOP_STRINGS)
        for n, item in enumerate(value):
            if not isinstance(item, str):
                raise invalid_type(f"{param}[{n}]", "a string", item)
            check_length(f"{param}[{n}]", item, 1, MAX_STOP_CHARS)

    def json_schema(self) -> dict[str, Any]:
        text = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
        strings = {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": text}
        return {"anyOf": [text, strings, {"type": "null"}]}


@dataclass(frozen=True)
class StreamOptions:
    def check(self, param: str, value: Any) -> None:
        if not isinstance(value, dict):
            raise invalid_type(param, "an object", value)
        flag = value.get("include_usage")
        if flag is not None and not isinstance(flag, bool):
            raise invalid_type(f"{param}.include_usage", "a boolean", flag)

    def json_schema(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class Unsupported:
    """A feature this server does not implement: only its no-op values are accepted."""

    accepted: tuple[Any, ...]
    expected: str  # the accepted JSON type, for a wrong type
    is_type: Callable[[Any], bool]
    why: str = ""  # a sentence after the refusal: why not, and what to do instead

    def check(self, param: str, value: Any) -> None:
        if not self.is_type(value):
            raise invalid_type(param, self.expected, value)
        if value not in self.accepted:
            why = f" {self.why}" if self.why else ""
            raise FieldError(
                f"Unsupported parameter: '{param}' is not supported on this server.{why}",
                param,
                "unsupported_parameter",
            )

    def json_schema(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class LogitBias:
    """OpenAI's ``logit_bias``: an object of at most ``MAX_LOGIT_BIAS_TOKENS`` token ids (as
    strings of digits) to a bias in [-100, 100]. Whether an id is in the model's vocabulary is
    the engine's to say."""

    def check(self, param: str, value: Any) -> None:
        if not isinstance(value, dict):
            raise invalid_type(param, "an object", value)
        if len(value) > MAX_LOGIT_BIAS_TOKENS:
            raise FieldError(
                f"Invalid '{param}': too many tokens. Expected at most {MAX_LOGIT_BIAS_TOKENS} "
                f"token ids, but got {len(value)} instead.",
                param,
                "invalid_value",
            )
        for key, bias in value.items():
            # At most 10 digits before int(): Python refuses to convert very long digit strings.
            is_digits = isinstance(key, str) and key.isascii() and key.isdigit()
            if not (is_digits and len(key) <= 10 and int(key) <= MAX_TOKEN_ID):
                raise FieldError(
                    f"Invalid '{param}': {str(key)[:32]!r} is not a token id (an integer from 0 "
                    f"to {MAX_TOKEN_ID}, written as a string).",
                    param,
                    "invalid_value",
                )
            Decimal(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS).check(f"{param}.{key}", bias)

    def json_schema(self) -> dict[str, Any]:
        bias = {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS}
        return {
            "type": "object",
            "maxProperties": MAX_LOGIT_BIAS_TOKENS,
            "propertyNames": {"pattern": "^[0-9]{1,10}$"},
            "additionalProperties": bias,
        }


def _is_object(value: Any) -> bool:
    return isinstance(value, dict)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_array(value: Any) -> bool:
    return isinstance(value, list)


def _is_string_or_object(value: Any) -> bool:
    return isinstance(value, str | dict)


Rule = (
    Decimal
    | Integer
    | Boolean
    | Text
    | Stop
    | StreamOptions
    | Unsupported
    | ResponseFormat
    | StructuredOutputs
    | Tools
    | ToolChoice
    | LogitBias
    | Prompt
)

_MAX_TOKENS = Integer(1, MAX_INT32)
_COMMON: dict[str, Rule] = {
    "model": Text(MAX_MODEL_CHARS, min_chars=1, is_printable=True),
    "max_tokens": _MAX_TOKENS,
    "temperature": Decimal(0.0, 2.0),
    "top_p": Decimal(0.0, 1.0, is_low_open=True),
    "top_k": Integer(-1, MAX_INT32),  # an extension (as vLLM's): -1 and 0 both disable it
    "seed": Integer(MIN_SEED, MAX_SEED),
    "stop": Stop(),
    "n": Integer(1, MAX_CHOICES),
    "stream": Boolean(),
    "stream_options": StreamOptions(),
    "ignore_eos": Boolean(),  # an extension
    "user": Text(MAX_USER_CHARS),
    "presence_penalty": Decimal(-2.0, 2.0),
    "frequency_penalty": Decimal(-2.0, 2.0),
    "repetition_penalty": Decimal(0.0, MAX_REPETITION_PENALTY, is_low_open=True),  # extension
    "logit_bias": LogitBias(),
    "response_format": ResponseFormat(),  # an extension on /v1/completions
    "structured_outputs": StructuredOutputs(),  # an extension (as vLLM's)
}
RULES: dict[Endpoint, dict[str, Rule]] = {
    "chat": {
        **_COMMON,
        "max_completion_tokens": _MAX_TOKENS,
        "logprobs": Boolean(),
        "top_logprobs": Integer(0, MAX_LOGPROBS),
        "tools": Tools(),
        "tool_choice": ToolChoice(),
        "parallel_tool_calls": Boolean(),
        # Deprecated by OpenAI for tools and tool_choice: refused rather than half-supported.
        "functions": Unsupported(([],), "an array", _is_array),
        "function_call": Unsupported(("none",), "a string or an object", _is_string_or_object),
    },
    "completions": {
        **_COMMON,
        "prompt": Prompt(),
        "logprobs": Integer(0, MAX_LOGPROBS),
        "echo": Boolean(),
        "best_of": Unsupported(
            (1,),
            "an integer",
            _is_integer,
            "Ask for 'n' choices and pick among them (vLLM's V1 dropped best_of too).",
        ),
        "suffix": Unsupported(
            ("",),
            "a string",
            lambda v: isinstance(v, str),
            "This server has no fill-in-the-middle.",
        ),
    },
}


def check_fields(data: Mapping[str, Any], endpoint: Endpoint) -> None:
    """Raise :class:`FieldError` for the first field in ``data`` that breaks its rule."""
    rules = RULES[endpoint]
    for name, value in data.items():
        rule = rules.get(name)
        if rule is not None and value is not None:
            rule.check(name, value)
    if endpoint == "chat" and data.get("top_logprobs") and data.get("logprobs") is not True:
        raise FieldError(
            "Invalid 'top_logprobs': 'logprobs' must be set to true when 'top_logprobs' is used.",
            "top_logprobs",
            "invalid_value",
        )
    if endpoint == "chat":
        check_tool_choice(data)
        check_content_parts(data.get("messages"))
    check_one_constraint(data)
    if data.get("stream_options") is not None and data.get("stream") is not True:
        raise FieldError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "stream_options",
            "invalid_value",
        )
    if endpoint == "completions":
        n = data.get("n") or 1  # null is "not given"
        choices = num_prompts(data.get("prompt")) * n
        if choices > MAX_CHOICES:
            raise FieldError(
                f"Invalid 'n': {n} choices for each of "
                f"{num_prompts(data.get('prompt'))} prompts make {choices}; at most "
                f"{MAX_CHOICES} choices per request.",
                "n",
                "invalid_value",
            )


def drop_nulls(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without its ``null`` fields (in ``stream_options`` too): null is "not given"."""
    options = data.get("stream_options")
    has_null_option = isinstance(options, dict) and None in options.values()
    if None not in data.values() and not has_null_option:
        return data
    out = {k: v for k, v in data.items() if v is not None}
    options = out.get("stream_options")
    if isinstance(options, dict):
        out["stream_options"] = {k: v for k, v in options.items() if v is not None}
    return out
