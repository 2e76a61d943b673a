"""The spill file: an append lands whole or not at all, even when the kernel refuses it (a
file that cannot grow, ``RLIMIT_FSIZE``: ``EFBIG``), a torn last line is cut on reading, and
the probe leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.storage.spill_file import PROBE_BYTES, SpillFile, SpillFileHeldError

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_appends_past_the_file_size_limit_are_refused_whole_and_never_land(
    tmp_path: Path,
) -> None:
    """A child whose files may not grow past 1,000 bytes (the kernel's own refusal, as on a
    full quota): each append either lands whole or raises, leaving the file as it was."""
    spill = tmp_path / "usage.jsonl"
    child = f"""
import resource, signal
from pathlib import Path
from gateway.storage.spill_file import SpillFile
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal's kill
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
spill = SpillFile(Path({str(spill)!r}))
for n in range(20):
    try:
        spill.append(b'{{"n": %d, "pad": "%s"}}\\n' % (n, b"x" * 60))
        print("ok", n)
    except OSError as exc:
        print("refused", n, exc.errno)
try:
    spill.probe()
    print("probe ok")
except OSError as exc:
    print("probe refused", exc.errno)
"""
    result = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60
    )
    assert result.returncode == 0, result.stderr
    outcomes = result.stdout.split("\n")
    accepted = [int(line.split()[1]) for line in outcomes if line.startswith("ok")]
    refused = [line for line in outcomes if line.startswith("refused")]
    assert accepted == list(range(len(accepted)))
    assert 0 < len(accepted) < 20
    assert len(refused) == 20 - len(accepted)
    assert all(line.endswith(" 27") for line in refused)  # EFBIG
    assert any(line.startswith("probe refused") for line in outcomes)
    lines = spill.read_bytes().splitlines(keepends=True)
    assert len(lines) == len(accepted)
    assert all(line.endswith(b"\n") and line.startswith(b'{"n": ') for line in lines)


def test_a_torn_last_line_is_cut_and_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    path.write_bytes(b'{"a": 1}\n\n' + b"\n" * 10 + b'{"b": 2}\n{"c": ')
    spill = SpillFile(path)
    assert list(spill.lines()) == [b'{"a": 1}', b'{"b": 2}']
    spill.append(b'{"d": 4}\n')
    spill.close()
    assert path.read_bytes().endswith(b'{"b": 2}\n{"d": 4}\n')


def test_the_probe_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    spill = SpillFile(path)
    spill.append(b'{"a": 1}\n')
    spill.probe()
    spill.append(b'{"b": 2}\n')
    spill.sync()
    assert path.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    assert PROBE_BYTES >= 1024
    spill.close()


def test_a_second_opener_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    first = SpillFile(path)
    with pytest.raises(SpillFileHeldError, match="held by another gateway"):
        SpillFile(path)
    first.replace([b'{"kept": 1}'])  # compaction keeps the lock on the new file
    with pytest.raises(SpillFileHeldError):
        SpillFile(path)
    first.close()
    SpillFile(path).close()
    assert path.read_bytes() == b'{"kept": 1}\n'
