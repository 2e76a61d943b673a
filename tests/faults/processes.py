"""Real processes for the fault suites: ``tollway serve`` with its engine child, and its records.

`Tollway.start` runs ``python -m gateway.launcher.serve_cli`` on a config that spawns one engine
(``small``, a tiny demo checkpoint: one engine keeps a loaded 2-core machine responsive),
waits for the banner and reads the first run's keys from it. The same data directory can be
started again after a crash (`Tollway.restart`); the keys stay valid. `shared_tollway` gives
the test session one of them.

Everything here is bounded: every wait has a deadline, every client call a timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.defaults import default_database_url
from gateway.storage.database import Database
from gateway.storage.usage_store import UsageEntry, list_usage
from tests.support.child_process import is_gone
from tests.support.polling import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "small"
START_TIMEOUT_S = 120.0
CLIENT_TIMEOUT = httpx.Timeout(60.0, connect=5.0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def short_dir(prefix: str) -> Path:
    """A short directory: Unix socket paths must stay under 108 bytes."""
    return Path(tempfile.mkdtemp(prefix=prefix))


@dataclass
class Tollway:
    """One ``tollway serve`` process (the gateway) and its engine child."""

    data_dir: Path
    config: Path
    port: int
    api_key: str = ""
    admin_key: str = ""
    process: subprocess.Popen[str] | None = None
    lines: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    @classmethod
    def start(cls, root: Path, checkpoint: Path, engine_args: tuple[str, ...] = ()) -> Tollway:
        args = ", ".join(f'"{arg}"' for arg in ("--max-num-seqs", "32", *engine_args))
        tollway = cls.launch(
            root,
            "drain_delay_s: 0\n"  # `stop` (SIGTERM) need not wait for load balancers
            f"models:\n  {MODEL}:\n    spawn: {{checkpoint: {checkpoint}, args: [{args}]}}\n",
        )
        tollway.api_key = tollway._banner_value("TOLLWAY_API_KEY")
        tollway.admin_key = tollway._banner_value("TOLLWAY_ADMIN_KEY")
        return tollway

    @classmethod
    def launch(cls, root: Path, config_text: str) -> Tollway:
        """``tollway serve`` on a config of the caller's (written to ``root/tollway.yaml``),
        its data in ``root/data``; started when this returns."""
        config = root / "tollway.yaml"
        config.write_text(config_text)
        tollway = cls(data_dir=root / "data", config=config, port=free_port())
        tollway._launch()
        return tollway

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def engine_socket(self) -> Path:
        return self.data_dir / "run" / f"{MODEL}.sock"

    def engine_pid(self) -> int:
        """The engine child's pid (it changes when the watchdog restarts the engine)."""
        children = []  # a restarted engine is a child of the watchdog thread, not the main one
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                children += [int(p) for p in (task / "children").read_text().split()]
            except OSError:  # a thread that has just ended
                continue
        alive = [pid for pid in children if not is_gone(pid)]
        assert len(alive) == 1, f"expected one engine child, found {alive}"
        return alive[0]

    def restart(self) -> None:
        """Start ``tollway serve`` again on the same data directory (after `kill`)."""
        assert self.process is not None
        assert self.process.poll() is not None
        self.lines.clear()
        self._launch()

    def kill(self) -> None:
        """SIGKILL the gateway; its engine gets SIGKILL too (``PR_SET_PDEATHSIG``)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        if self._reader is not None:
            self._reader.join(timeout=5)

    def stop(self) -> None:
        """SIGTERM (a clean stop), SIGKILL if it takes more than 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=5)

    def output(self) -> str:
        return "".join(self.lines)

    def engine_log(self) -> str:
        path = self.data_dir / "logs" / f"{MODEL}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- clients ---------------------------------------------------------------------

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=CLIENT_TIMEOUT)

    def engine_client(self) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=str(self.engine_socket))
        return httpx.Client(base_url="http://engine", transport=transport, timeout=10.0)

    def engine_metric(self, name: str) -> float:
        with self.engine_client() as engine:
            text = engine.get("/metrics").text
        match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        assert match is not None, f"{name} not in the engine's metrics"
        return float(match.group(1))

    def is_engine_healthy(self) -> bool:
        """Whether the engine is ready (``/ready``: loaded; ``/health`` answers earlier)."""
        try:
            with self.engine_client() as engine:
                return engine.get("/ready").status_code == 200
        except httpx.HTTPError:
            return False

    # -- the database ----------------------------------------------------------------

    def records(self) -> dict[str, UsageEntry]:
        """Every usage record in the database, by request id."""
        database = Database(default_database_url(self.data_dir))
        try:
            with database.session() as session:
                found: dict[str, UsageEntry] = {}
                cursor: int | None = None
                while True:
                    page = list_usage(session, cursor=cursor, limit=1000)
                    found.update((entry.request_id, entry) for entry in page.records)
                    if page.next_cursor is None:
                        return found
                    cursor = page.next_cursor
        finally:
            database.dispose()

    def wait_for_records(self, request_ids: set[str], timeout_s: float = 30.0) -> None:
        wait_until(lambda: request_ids <= self.records().keys(), timeout_s, "the usage records")

    # -- internals -------------------------------------------------------------------

    def _launch(self) -> None:
        command = [
            sys.executable,
            "-m",
            "gateway.launcher.serve_cli",
            "--config",
            str(self.config),
            "--data-dir",
            str(self.data_dir),
            "--port",
            str(self.port),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
        self.process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        stdout = self.process.stdout
        assert stdout is not None
        self._reader = threading.Thread(
            target=lambda: self.lines.extend(iter(stdout.readline, "")), daemon=True
        )
        self._reader.start()
        process = self.process

        def has_started_or_exited() -> bool:
            banner = any("Tollway is ready" in line for line in self.lines)
            return banner or process.poll() is not None

        try:
            wait_until(has_started_or_exited, START_TIMEOUT_S, "the banner")
            assert process.poll() is None, f"exited with {process.returncode}"
        except AssertionError as exc:
            process.kill()
            output = self.output()[-4000:]
            raise AssertionError(f"tollway serve did not start ({exc}):\n{output}") from None
        wait_until(lambda: _can_connect(self.port), 30, "the gateway's port")

    def _banner_value(self, name: str) -> str:
        wait_until(lambda: f"{name}=" in self.output(), 10, f"{name} in the banner")
        match = re.search(rf"{name}=(\S+)", self.output())
        assert match is not None
        return match.group(1)


@dataclass
class TcpEngine:
    """``python -m backend_engine`` on TCP ``address:port``, serving ``model``; restartable
    on the same address (`gateway.launcher.engine_processes.EngineProcess` spawns the
    Unix-socket engines of ``tollway serve``; a replica behind a DNS name needs an address)."""

    checkpoint: Path
    address: str
    port: int
    log: Path
    model: str = "chat"
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def start(self) -> TcpEngine:
        command = [
            sys.executable, "-m", "backend_engine", "--model", str(self.checkpoint),
            "--host", self.address, "--port", str(self.port), "--served-model-name", self.model,
            "--num-threads", "1", "--num-kv-blocks", "128",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=log, env=env)
        wait_until(self.is_ready, 120, f"engine {self.url} to be ready\n{self.tail()}")
        return self

    def is_ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"engine {self.url} exited\n{self.tail()}")
        try:
            return httpx.get(self.url + "/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        assert is_gone(self.process.pid)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def num_requests(self) -> int:
        """Chat requests this engine process has answered or is answering."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return int(
            sum(
                float(line.rpartition(" ")[2])
                for line in text.splitlines()
                if line.startswith("tollway_engine_http_requests_total{") and "chat" in line
            )
        )

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""


def _can_connect(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


_SHARED = pytest.StashKey[Tollway]()


def shared_tollway(config: pytest.Config, checkpoint: Path) -> Tollway:
    """The session's one `Tollway` (started on first use, stopped when the session ends), so
    the fault suites pay for one start, not one per module. Tests that break it (kill the
    engine or the gateway) wait for it to recover, or restart it, before they return; this
    also waits until it answers, in case one could not."""
    tollway = config.stash.get(_SHARED, None)
    if tollway is None:
        root = short_dir("tw-faults-")
        try:
            tollway = Tollway.start(root, checkpoint)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        config.stash[_SHARED] = tollway

        def clean_up(tollway: Tollway = tollway) -> None:
            tollway.stop()
            shutil.rmtree(root, ignore_errors=True)

        config.add_cleanup(clean_up)
    if tollway.process is not None and tollway.process.poll() is not None:
        tollway.restart()
    wait_until(tollway.is_engine_healthy, 90, f"a healthy engine\n{tollway.output()[-3000:]}")
    return tollway


# -- streams -------------------------------------------------------------------------


@dataclass
class StreamSeen:
    """What a client received on one streamed request."""

    request_id: str = ""
    status_code: int = 0
    chunks: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    is_done: bool = False  # the stream ended with [DONE]
    events_after_done: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens received: logprobs entries (exact: one per token), as the relay counts them."""
        total = 0
        for chunk in self.chunks:
            for choice in chunk.get("choices") or ():
                content = (choice.get("logprobs") or {}).get("content") or ()
                total += len(content)
        return total

    @property
    def usage(self) -> dict[str, Any] | None:
        for chunk in self.chunks:
            if chunk.get("usage"):
                return dict(chunk["usage"])
        return None

    @property
    def text(self) -> str:
        return "".join(
            (choice.get("delta") or {}).get("content") or ""
            for chunk in self.chunks
            for choice in chunk.get("choices") or ()
        )


def chat_body(max_tokens: int, *, stream: bool, content: str = "Tell me a story") -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "logprobs": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def read_stream(
    response: httpx.Response,
    on_chunk: Callable[[StreamSeen], None] | None = None,
    into: StreamSeen | None = None,
) -> StreamSeen:
    """Read an SSE answer to its end, calling ``on_chunk`` after each data chunk. ``into``
    (filled as events arrive) keeps what was read if the connection then fails."""
    seen = into if into is not None else StreamSeen()
    seen.request_id = response.headers.get("x-request-id", "")
    seen.status_code = response.status_code
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if seen.is_done:
            seen.events_after_done += 1
        elif payload == "[DONE]":
            seen.is_done = True
        else:
            chunk = orjson.loads(payload)
            if "error" in chunk:
                seen.errors.append(chunk["error"])
            else:
                seen.chunks.append(chunk)
                if on_chunk is not None:
                    on_chunk(seen)
    return seen
