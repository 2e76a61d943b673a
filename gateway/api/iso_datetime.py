"""ISO 8601 dates and date-times read the same on every Python the gateway supports.

Python 3.11's ``datetime.fromisoformat`` reads RFC 3339 date-times (a ``Z`` offset, any
number of fractional digits, ``t`` as separator); 3.10's reads only what ``isoformat``
writes. RFC 3339 forms are rewritten into what both read, to the same value; anything else
goes to ``fromisoformat`` as given.
"""

from __future__ import annotations

import re
from datetime import datetime

_RFC3339 = re.compile(
    r"(?P<date>\d{4}-\d\d-\d\d)[Tt](?P<time>\d\d:\d\d(?::\d\d)?)"
    r"(?:(?<=:\d\d:\d\d)[.,](?P<fraction>\d+))?(?P<offset>Z|[+-]\d\d:?\d\d)?"
)


def parse_iso_datetime(value: str) -> datetime:
    """``datetime.fromisoformat(value)`` as Python 3.11 reads it; ``ValueError`` if invalid
    (one message on every Python). Fractional seconds past microseconds are cut off, as 3.11
    does."""
    try:
        return datetime.fromisoformat(_as_both_read(value))
    except ValueError:
        raise ValueError(f"not an ISO 8601 date or date-time: {value!r}") from None


def _as_both_read(value: str) -> str:
    match = _RFC3339.fullmatch(value)
    if match is None:
        return value
    fraction = match["fraction"]
    micros = f".{fraction[:6].ljust(6, '0')}" if fraction else ""
    offset = match["offset"] or ""
    if offset == "Z":
        offset = "+00:00"
    elif len(offset) == 5:  # +hhmm
        offset = f"{offset[:3]}:{offset[3:]}"
    return f"{match['date']}T{match['time']}{micros}{offset}"
