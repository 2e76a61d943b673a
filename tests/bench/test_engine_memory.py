"""bench.engine_memory: reading /proc/PID/status."""

from __future__ import annotations

import os

import pytest

from bench.engine_memory import read_kib, status_kib

STATUS = "Name:\tpython\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\nThreads:\t3\n"


def test_status_fields_read_in_kib() -> None:
    assert status_kib(STATUS, "VmRSS") == 102400
    assert status_kib(STATUS, "VmHWM") == 204800


def test_a_missing_field_or_another_unit_is_refused() -> None:
    with pytest.raises(ValueError, match="no VmSwap"):
        status_kib(STATUS, "VmSwap")
    with pytest.raises(ValueError, match="not kB"):
        status_kib("VmRSS:\t12 MB\n", "VmRSS")


def test_this_process_peak_is_at_least_its_resident_set() -> None:
    rss = read_kib(os.getpid(), "VmRSS")
    assert 0 < rss <= read_kib(os.getpid(), "VmHWM")
