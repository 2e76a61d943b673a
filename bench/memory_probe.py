"""On-demand memory readings from inside a benchmark's server process, for `bench.soak`.

A server started by `bench.gateway_stack` calls `install_from_environment` before serving.
When ``TOLLWAY_BENCH_PROBE_DIR`` is set in its environment, the process starts tracemalloc
(``TOLLWAY_BENCH_PROBE_FRAMES`` frames per allocation, default 1; 0 leaves it off) and
answers SIGUSR1 by writing, under that directory::

    <role>-<pid>-<n>.tracemalloc   a tracemalloc snapshot (tracemalloc.Snapshot.load)
    <role>-<pid>-<n>.json          gc-tracked objects by type, RSS, and glibc malloc's
                                   totals (mallinfo2: bytes in use, and bytes it holds free)

where ``n`` counts the signals. Without the variable it does nothing: tracemalloc slows
every allocation, so it stays off in the benches that measure time. `compare` reads two
readings and says what grew between them: Python objects (tracemalloc, by source line),
memory malloc hands out (native allocations: SQLite's page cache, torch's CPU tensors...),
or memory malloc keeps free without returning it (fragmentation, arenas).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import tracemalloc
from collections import Counter
from pathlib import Path
from types import FrameType

PROBE_DIR_ENV = "TOLLWAY_BENCH_PROBE_DIR"
FRAMES_ENV = "TOLLWAY_BENCH_PROBE_FRAMES"


def install_from_environment(role: str) -> None:
    """Start tracemalloc and answer SIGUSR1 with a reading, if the environment asks for it."""
    directory = os.environ.get(PROBE_DIR_ENV)
    if not directory:
        return
    num_frames = int(os.environ.get(FRAMES_ENV, "1"))
    if num_frames > 0:
        tracemalloc.start(num_frames)
    num_readings = 0

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal num_readings
        num_readings += 1
        stem = Path(directory) / f"{role}-{os.getpid()}-{num_readings}"
        write_reading(stem)

    signal.signal(signal.SIGUSR1, on_signal)


def write_reading(stem: Path) -> None:
    """``stem``.tracemalloc and ``stem``.json (written last: its presence means both are done)."""
    gc.collect()
    if tracemalloc.is_tracing():
        tracemalloc.take_snapshot().dump(f"{stem}.tracemalloc")
    types = Counter(type(o).__qualname__ for o in gc.get_objects())
    status = Path("/proc/self/status").read_text().splitlines()
    rss = next((line.split()[1] for line in status if line.startswith("VmRSS:")), "0")
    reading = {"types": dict(types), "rss_kib": int(rss), "malloc": malloc_totals()}
    tmp = Path(f"{stem}.json.tmp")
    tmp.write_text(json.dumps(reading))
    tmp.replace(f"{stem}.json")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",  # bytes from the OS through brk/sbrk, all arenas
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",  # bytes in mmap'ed chunks (large allocations)
            "usmblks",
            "fsmblks",
            "uordblks",  # bytes in use in the arenas
            "fordblks",  # bytes free in the arenas (held, not returned to the OS)
            "keepcost",
        )
    ]


def malloc_totals() -> dict[str, int]:
    """glibc's ``mallinfo2()`` over all arenas: ``in_use`` and ``free`` bytes (empty where
    the C library has no such call)."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return {}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"in_use": info.uordblks + info.hblkhd, "free": info.fordblks}


def compare(before: Path, after: Path, *, top: int = 15) -> list[str]:
    """Lines saying what grew from reading ``before`` to ``after`` (stems, no suffix): RSS
    and malloc's totals, tracemalloc's largest growths by source line (when it ran), then
    the gc-tracked types whose counts grew most."""
    old_reading = json.loads(Path(f"{before}.json").read_text())
    new_reading = json.loads(Path(f"{after}.json").read_text())
    lines = [f"RSS {(new_reading['rss_kib'] - old_reading['rss_kib']) / 1024:+.2f} MiB"]
    old_malloc, new_malloc = old_reading.get("malloc", {}), new_reading.get("malloc", {})
    if old_malloc and new_malloc:
        lines[0] += (
            f"; malloc in use {new_malloc['in_use'] / 2**20:.1f} MiB "
            f"({(new_malloc['in_use'] - old_malloc['in_use']) / 2**20:+.2f}), held free "
            f"{new_malloc['free'] / 2**20:.1f} MiB "
            f"({(new_malloc['free'] - old_malloc['free']) / 2**20:+.2f})"
        )
    if Path(f"{before}.tracemalloc").exists() and Path(f"{after}.tracemalloc").exists():
        old = tracemalloc.Snapshot.load(f"{before}.tracemalloc")
        new = tracemalloc.Snapshot.load(f"{after}.tracemalloc")
        stats = new.compare_to(old, "lineno")
        total = sum(s.size for s in new.statistics("filename"))
        lines.append(
            f"python heap (tracemalloc) {total / 2**20:.1f} MiB, "
            f"{sum(s.size_diff for s in stats) / 2**20:+.2f} MiB; largest growths by line:"
        )
        for stat in sorted(stats, key=lambda s: s.size_diff, reverse=True)[:top]:
            frame = stat.traceback[0]
            lines.append(
                f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+8d} blocks  "
                f"{frame.filename}:{frame.lineno}"
            )
    old_types, new_types = old_reading["types"], new_reading["types"]
    growth = {name: n - old_types.get(name, 0) for name, n in new_types.items()}
    lines.append("gc-tracked objects, largest growths by type:")
    for name, diff in sorted(growth.items(), key=lambda kv: kv[1], reverse=True)[:top]:
        if diff > 0:
            lines.append(f"  {diff:+8d}  {name} (now {new_types[name]})")
    return lines
