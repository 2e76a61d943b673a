"""ISO 8601 query times read as Python 3.11's ``datetime.fromisoformat`` reads them, on 3.10
too (CI runs the gateway's tests on both)."""

from __future__ import annotations

import pytest

from gateway.api.iso_datetime import parse_iso_datetime

# (input, what Python 3.11's fromisoformat makes of it, as isoformat)
AS_PYTHON_3_11_READS = [
    ("2025-03-01", "2025-03-01T00:00:00"),
    ("2025-03-01T12:00:00", "2025-03-01T12:00:00"),
    ("2025-03-01 12:00:00", "2025-03-01T12:00:00"),
    ("2025-03-01T12:00:00Z", "2025-03-01T12:00:00+00:00"),
    ("2025-03-01t12:00:00Z", "2025-03-01T12:00:00+00:00"),
    ("2025-03-01T12:00Z", "2025-03-01T12:00:00+00:00"),
    ("2025-03-01T12:00:00.1Z", "2025-03-01T12:00:00.100000+00:00"),
    ("1501-04-14T21:22:07.9675Z", "1501-04-14T21:22:07.967500+00:00"),
    ("2025-03-01T12:00:00,5Z", "2025-03-01T12:00:00.500000+00:00"),
    ("2025-03-01T12:00:00.000000001+00:00", "2025-03-01T12:00:00+00:00"),
    ("2025-03-01T12:00:00.5+05:30", "2025-03-01T12:00:00.500000+05:30"),
    ("2025-03-01T12:00:00+0530", "2025-03-01T12:00:00+05:30"),
    ("2025-03-01T12:00:00-00:00", "2025-03-01T12:00:00+00:00"),
    ("2000-01-01T02:00:00+00:04", "2000-01-01T02:00:00+00:04"),
]


@pytest.mark.parametrize(("text", "expected"), AS_PYTHON_3_11_READS)
def test_rfc_3339_and_iso_forms_read_as_python_3_11_reads_them(text: str, expected: str) -> None:
    assert parse_iso_datetime(text).isoformat() == expected


@pytest.mark.parametrize(
    "text", ["", "Z", "2025-03-01T12:00:00z", "2025-03-01T24:00:00Z", "2025-13-01", "yesterday"]
)
def test_what_python_3_11_refuses_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not an ISO 8601 date or date-time"):
        parse_iso_datetime(text)
