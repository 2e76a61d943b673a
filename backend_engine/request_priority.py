"""Scheduling priority classes."""

from __future__ import annotations

from enum import IntEnum


class Priority(IntEnum):
    """Lower value is served first."""

    INTERACTIVE = 0
    BATCH = 1

    @classmethod
    def parse(cls, value: str | int | Priority) -> Priority:
        if isinstance(value, Priority):
            return value
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[value.strip().upper()]
        except KeyError:
            names = ", ".join(p.name.lower() for p in cls)
            raise ValueError(f"priority must be one of {names}, got {value!r}") from None
