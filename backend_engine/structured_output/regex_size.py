"""A bound on how far a regex's counted repetitions expand, checked before llguidance sees it.

llguidance builds its lexer lazily, so ``(a|b)*a(a|b){1000}`` (which explodes a DFA built up
front) costs it nothing. What it cannot serve is nested counted repetition:
``((a{100}){100}){100}`` is a million copies of ``a``; it compiles, then fails on the first
token ("too many expressions constructed"). This module refuses such a pattern up front, so the
request gets a 400 naming it instead of an engine error mid-generation.

It reads the pattern with Python's own regex parser, which understands the syntax clients send
(the Rust-only constructs it cannot read are left to llguidance, which reports them itself).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator

if sys.version_info >= (3, 11):
    from re import _constants as sre_constants
    from re import _parser as sre_parse
else:  # pragma: no cover (3.10)
    import sre_constants
    import sre_parse

# Copies of a sub-pattern that counted repetitions may make. llguidance serves 100,000 in
# about 0.7 s of lexer building and fails at about a million.
MAX_EXPANDED_SIZE = 100_000


_REPEATS = tuple(
    getattr(sre_constants, name)
    for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
    if hasattr(sre_constants, name)
)


def check_regex_size(pattern: str) -> None:
    """Raise ValueError when the counted repetitions of ``pattern`` expand past the bound."""
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, OverflowError, RecursionError):
        return
    size = _size(parsed)
    if size > MAX_EXPANDED_SIZE:
        raise ValueError(
            f"the regex {_shortened(pattern)!r} has nested counted repetitions that expand to "
            f"{size:,} copies (at most {MAX_EXPANDED_SIZE:,})"
        )


def check_schema_patterns(schema: object) -> None:
    """``check_regex_size`` on every ``pattern`` and ``patternProperties`` key in a schema."""
    for pattern in _schema_patterns(schema):
        check_regex_size(pattern)


def _schema_patterns(schema: object) -> Iterator[str]:
    """Every ``pattern`` (and ``patternProperties`` key) in a schema, however nested."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            elif key == "patternProperties" and isinstance(value, dict):
                yield from (k for k in value if isinstance(k, str))
            yield from _schema_patterns(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from _schema_patterns(item)


def _size(items: object) -> int:
    """The expanded size of a parsed (sub)pattern: repetitions multiply, sequences add."""
    total = 0
    for op, arg in items:  # type: ignore[attr-defined]
        if op in _REPEATS:
            low, high, sub = arg
            count = high if high != sre_constants.MAXREPEAT else max(low, 1)
            total += max(count, 1) * _size(sub)
        elif op is sre_constants.SUBPATTERN:
            total += _size(arg[-1])
        elif op is sre_constants.BRANCH:
            total += max((_size(branch) for branch in arg[1]), default=0)
        else:
            total += 1
        if total > MAX_EXPANDED_SIZE:
            return total
    return total


def _shortened(pattern: str) -> str:
    return pattern if len(pattern) <= 60 else pattern[:57] + "..."
