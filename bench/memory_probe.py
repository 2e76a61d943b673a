"""On-demand memory readings from inside a benchmark's server process, for `bench.soak`.

A server started by `bench.gateway_stack` calls `install_from_environment` before serving.
When ``TOLLWAY_BENCH_PROBE_DIR`` is set in its environment, the process starts tracemalloc
(``TOLLWAY_BENCH_PROBE_FRAMES`` frames per allocation, default 1) and answers SIGUSR1 by
writing, under that directory::

    <role>-<pid>-<n>.tracemalloc   a tracemalloc snapshot (tracemalloc.Snapshot.load)
    <role>-<pid>-<n>.json          {"types": {type name: live objects, gc-tracked}, "rss": ..}

where ``n`` counts the signals. Without the variable it does nothing: tracemalloc slows
every allocation, so it stays off in the benches that measure time. `compare` reads two
readings and says what grew between them.
"""

from __future__ import annotations

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
    tracemalloc.start(int(os.environ.get(FRAMES_ENV, "1")))
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
    tracemalloc.take_snapshot().dump(f"{stem}.tracemalloc")
    types = Counter(type(o).__qualname__ for o in gc.get_objects())
    status = Path("/proc/self/status").read_text().splitlines()
    rss = next((line.split()[1] for line in status if line.startswith("VmRSS:")), "0")
    reading = {"types": dict(types), "rss_kib": int(rss)}
    tmp = Path(f"{stem}.json.tmp")
    tmp.write_text(json.dumps(reading))
    tmp.replace(f"{stem}.json")


def compare(before: Path, after: Path, *, top: int = 15) -> list[str]:
    """Lines saying what grew from reading ``before`` to ``after`` (stems, no suffix):
    tracemalloc's largest growths by source line, then the gc-tracked types whose counts
    grew most."""
    old = tracemalloc.Snapshot.load(f"{before}.tracemalloc")
    new = tracemalloc.Snapshot.load(f"{after}.tracemalloc")
    stats = new.compare_to(old, "lineno")
    lines = [
        f"python heap (tracemalloc) {sum(s.size for s in new.statistics('filename')) / 2**20:.1f}"
        f" MiB, {sum(s.size_diff for s in stats) / 2**20:+.2f} MiB; largest growths by line:"
    ]
    for stat in sorted(stats, key=lambda s: s.size_diff, reverse=True)[:top]:
        frame = stat.traceback[0]
        lines.append(
            f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+8d} blocks  "
            f"{frame.filename}:{frame.lineno}"
        )
    old_types = json.loads(Path(f"{before}.json").read_text())["types"]
    new_types = json.loads(Path(f"{after}.json").read_text())["types"]
    growth = {name: n - old_types.get(name, 0) for name, n in new_types.items()}
    lines.append("gc-tracked objects, largest growths by type:")
    for name, diff in sorted(growth.items(), key=lambda kv: kv[1], reverse=True)[:top]:
        if diff > 0:
            lines.append(f"  {diff:+8d}  {name} (now {new_types[name]})")
    return lines
