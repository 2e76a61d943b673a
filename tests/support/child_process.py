"""A function run in a spawned process of its own (a gateway to SIGKILL, an engine), the wait
for its HTTP server to answer, and whether a process has exited."""

from __future__ import annotations

import multiprocessing
import os
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support.polling import wait_until


@contextmanager
def child_process(target: Callable[..., None], *args: Any) -> Iterator[int]:
    """A spawned process running ``target(*args)``; terminated (SIGTERM) on exit. Yields its pid."""
    process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    process.start()
    try:
        assert process.pid is not None
        yield process.pid
    finally:
        process.terminate()
        process.join(timeout=30)
        if process.is_alive():
            process.kill()


def wait_http(url: str, pid: int, timeout_s: float = 60.0) -> None:
    """Return once ``url`` answers 200; raise ``RuntimeError`` if process ``pid`` exits first."""

    def answers() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            if not Path(f"/proc/{pid}").exists():
                raise RuntimeError(f"process {pid} serving {url} exited") from None
            return False

    wait_until(answers, timeout_s, f"{url} answers")


def is_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie awaiting its reaper counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"
