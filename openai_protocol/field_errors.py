"""A refused request field, and the sentences OpenAI's API refuses one with.

Every rule of ``field_rules`` (and of ``schema_rules`` and ``tool_rules``, which it gathers)
raises a :class:`FieldError` built here, so a message reads the same whichever field broke:
``Invalid type for 'x': ...``, ``Invalid 'x': string too long. ...``, ``Missing required
parameter: 'x'.``, ``Invalid value for 'x': 'v'. Supported values are: ...`` (OpenAI's
leaves the field to ``param``; ours names it in the message too). ``param`` is the
field's path as OpenAI writes it (``tools[3].function.name``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class FieldError(ValueError):
    """A client input that is refused with a 400, in OpenAI's words."""

    def __init__(self, message: str, param: str | None, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def kind_of(value: Any) -> str:
    """The JSON type of ``value``, as the messages name it (``an integer``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def invalid_type(param: str, expected: str, value: Any) -> FieldError:
    return FieldError(
        f"Invalid type for '{param}': expected {expected}, but got {kind_of(value)} instead.",
        param,
        "invalid_type",
    )


def missing_parameter(param: str) -> FieldError:
    return FieldError(
        f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
    )


def unknown_parameter(param: str) -> FieldError:
    return FieldError(f"Unknown parameter: '{param}'.", param, "unknown_parameter")


def _quoted_list(values: Sequence[str]) -> str:
    quoted = [f"'{v}'" for v in values]
    if len(quoted) <= 2:
        return " and ".join(quoted)
    return ", ".join(quoted[:-1]) + ", and " + quoted[-1]


def check_one_of(param: str, value: Any, supported: Sequence[str]) -> None:
    """``value`` is one of the ``supported`` strings (OpenAI's ``invalid_value``)."""
    if not isinstance(value, str):
        raise invalid_type(param, "a string", value)
    if value not in supported:
        raise FieldError(
            f"Invalid value for '{param}': '{value}'. Supported values are: "
            f"{_quoted_list(supported)}.",
            param,
            "invalid_value",
        )


def check_length(param: str, value: str, min_chars: int, max_chars: int) -> None:
    if len(value) < min_chars:
        raise FieldError(
            f"Invalid '{param}': empty string. Expected a string with minimum length "
            f"{min_chars}, but got an empty string instead.",
            param,
            "empty_string",
        )
    if len(value) > max_chars:
        raise FieldError(
            f"Invalid '{param}': string too long. Expected a string with maximum length "
            f"{max_chars}, but got a string with length {len(value)} instead.",
            param,
            "string_above_max_length",
        )


def check_num_items(param: str, value: list[Any], min_items: int, max_items: int) -> None:
    if len(value) < min_items:
        raise FieldError(
            f"Invalid '{param}': empty array. Expected an array with minimum length "
            f"{min_items}, but got an empty array instead.",
            param,
            "empty_array",
        )
    if len(value) > max_items:
        raise FieldError(
            f"Invalid '{param}': array too long. Expected an array with maximum length "
            f"{max_items}, but got an array with length {len(value)} instead.",
            param,
            "array_above_max_length",
        )


def object_at(param: str, value: Any) -> dict[str, Any]:
    """``value`` as an object, or the ``invalid_type`` error."""
    if not isinstance(value, dict):
        raise invalid_type(param, "an object", value)
    return value


def optional_of(param: str, value: Any, kind: type, expected: str) -> None:
    """An optional member: absent or ``null``, or of ``kind`` (never a boolean for int)."""
    if value is None:
        return
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise invalid_type(param, expected, value)
