"""What a request's output must match, as plain data: the form and its canonical text.

Canonical means equal constraints get equal keys: a JSON Schema is re-serialized without
spaces, so the same schema sent twice, however it was spaced, is compiled once. Key order is
kept: it is the order in which the grammar generates an object's properties.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# Where a constraint came from, as the client named it: the 400 for a bad one names it.
ConstraintParam = str


@dataclass(frozen=True)
class OutputConstraint:
    """``kind`` and ``source``: the canonical JSON Schema, the regex, the JSON list of choices,
    or the Lark grammar. ``param`` is the request field it came from (for error messages)."""

    kind: ConstraintKind
    source: str
    param: ConstraintParam = "response_format"

    @property
    def key(self) -> str:
        """The cache key: equal for equal constraints, whichever field they came in."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, param: str) -> OutputConstraint:
        """``true`` is the schema ``{}`` (any JSON value); ``false`` admits nothing."""
        return cls("json_schema", canonical_json({} if schema is True else schema), param)

    @classmethod
    def json_object(cls, param: str) -> OutputConstraint:
        return cls("json_object", "", param)

    @classmethod
    def regex(cls, pattern: str, param: str) -> OutputConstraint:
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, choices: list[str], param: str) -> OutputConstraint:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False), param)

    @classmethod
    def grammar(cls, lark: str, param: str) -> OutputConstraint:
        return cls("grammar", lark, param)


def canonical_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class InvalidConstraint(ValueError):
    """A constraint that cannot be compiled: the message names the problem, ``param`` the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
