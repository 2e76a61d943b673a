"""Engines as child processes of ``tollway serve``: start, wait until ready, stop.

Each engine is ``python -m backend_engine --model CHECKPOINT --uds SOCKET``, the engine's own
entry point (this module is the only part of the gateway that knows it), with its output in a
log file (a pipe nobody reads would fill up and stall the engine). No engine outlives the
gateway:

- a clean stop (``stop()``, from a ``finally`` and from ``atexit``) sends SIGTERM to every
  engine, waits, then SIGKILLs the ones still running;
- if the gateway dies without running Python's cleanup (SIGKILL, a segfault), Linux delivers
  SIGKILL to each engine (``prctl(PR_SET_PDEATHSIG)``, set in the child before ``exec``);
- engines run in their own session, so a Ctrl-C in the terminal reaches only the gateway,
  which then stops them in order (the gateway first, so no request is cut off mid-way).

Once serving, ``watch()`` starts a watchdog thread: an engine that exits on its own (a crash,
the OOM killer) is started again after a back-off that doubles while it keeps dying soon
after starting (1 s up to 30 s) and resets once it has stayed up. Its log file is appended
to, so the crash stays readable. While it is down the gateway answers its requests with
an upstream error (or retries them on another replica of the same model).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO

import httpx

logger = logging.getLogger(__name__)

MAX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes with the terminating NUL
_PR_SET_PDEATHSIG = 1
_LOG_TAIL_LINES = 30
ENGINE_MODULE = "backend_engine"  # `python -m backend_engine`: the engine's entry point
_ERROR_PREFIX = "error: "  # how the engine's command reports what it refuses
FIRST_RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0
STABLE_UPTIME_S = 60.0  # an engine up this long has recovered: the back-off starts over
# The engine's accepted values for the settings `spawn:` names (`EngineConfig`'s, which the
# gateway cannot import; tests/gateway/launcher checks the two tables are the same).
QUANTIZATIONS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64)
KV_CACHE_DTYPES = ("auto", "int8")
SPECULATIVE_PROPOSERS = ("ngram", "draft")
# The engine's n-gram sizes when ``spawn:`` sets one of the two (min <= max is checked here).
DEFAULT_SPECULATIVE_NGRAM_MIN = 1
DEFAULT_SPECULATIVE_NGRAM_MAX = 4


class EngineStartError(RuntimeError):
    """An engine exited or did not become healthy; the message carries its log's tail."""


@dataclass(frozen=True)
class SpeculativeSpec:
    """Speculative decoding in a spawned engine. Each field is the `EngineConfig` field of the
    same name and becomes its flag; None leaves the engine's default."""

    speculative_proposer: str  # ngram or draft
    speculative_draft_model: Path | None = None  # the draft proposer's checkpoint
    num_speculative_tokens: int | None = None
    speculative_ngram_min: int | None = None
    speculative_ngram_max: int | None = None
    speculative_crossover_batch_size: int | None = None

    def flags(self) -> list[str]:
        flags: list[str] = []
        for setting in fields(self):
            value = getattr(self, setting.name)
            if value is not None:
                flags += ["--" + setting.name.replace("_", "-"), str(value)]
        return flags


@dataclass(frozen=True)
class EngineSpec:
    """One engine to spawn: serve ``checkpoint`` as ``name`` on the Unix socket ``socket_path``."""

    name: str
    checkpoint: Path
    socket_path: Path
    device: str = "cpu"
    quantization: str | None = None  # int8 or int4: a float checkpoint quantized at load
    quantization_group_size: int | None = None  # int4's values per scale (engine default 32)
    kv_cache_dtype: str | None = None  # auto or int8 (None: the engine's default)
    speculative: SpeculativeSpec | None = None  # None: the engine does not speculate
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(
                f"engine {self.name!r}: socket path {self.socket_path} is longer than "
                f"{MAX_SOCKET_PATH_BYTES} bytes; use a shorter data directory"
            )

    def command(self) -> list[str]:
        command = [
            sys.executable,
            "-m",
            ENGINE_MODULE,
            "--model",
            str(self.checkpoint),
            "--uds",
            str(self.socket_path),
            "--served-model-name",
            self.name,
            "--device",
            self.device,
        ]
        for flag, value in (
            ("--quantization", self.quantization),
            ("--quantization-group-size", self.quantization_group_size),
            ("--kv-cache-dtype", self.kv_cache_dtype),
        ):
            if value is not None:
                command += [flag, str(value)]
        if self.speculative is not None:
            command += self.speculative.flags()
        return [*command, *self.extra_args]


def is_socket_healthy(socket_path: Path, timeout_s: float = 1.0) -> bool:
    """Whether something answers ``GET /health`` with 200 on this Unix socket (a live
    engine, also while it loads its model)."""
    return _answers_200(socket_path, "/health", timeout_s)


def is_socket_ready(socket_path: Path, timeout_s: float = 1.0) -> bool:
    """Whether the engine on this Unix socket answers ``GET /ready`` with 200: its model is
    loaded and it takes requests."""
    return _answers_200(socket_path, "/ready", timeout_s)


def _answers_200(socket_path: Path, path: str, timeout_s: float) -> bool:
    transport = httpx.HTTPTransport(uds=str(socket_path))
    try:
        with httpx.Client(transport=transport, timeout=timeout_s, trust_env=False) as client:
            return client.get(f"http://engine{path}").status_code == 200
    except httpx.HTTPError:
        return False


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child get SIGKILL when this process dies (Linux only)."""
    parent_pid = os.getpid()
    libc_name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    libc = ctypes.CDLL(libc_name, use_errno=True) if libc_name is not None else None

    def preexec() -> None:
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent_pid:  # the parent died before prctl took effect
                os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class EngineProcess:
    """One running engine. ``stop()`` is idempotent."""

    def __init__(self, spec: EngineSpec, log_path: Path, *, append_log: bool = False) -> None:
        self.spec = spec
        self.log_path = log_path
        self.started_at = time.monotonic()
        if spec.socket_path.exists():
            if is_socket_healthy(spec.socket_path):
                raise EngineStartError(
                    f"engine {spec.name!r}: {spec.socket_path} is already served by another "
                    "process (is another `tollway serve` using this data directory?)"
                )
            spec.socket_path.unlink()  # left behind by a process that was killed
        spec.socket_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = log_path.open("ab" if append_log else "wb")
        self.process = subprocess.Popen(
            spec.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **spec.env},
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, num_lines: int = _LOG_TAIL_LINES) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def check_alive(self) -> None:
        """Raise `EngineStartError` if the engine has exited: with its own one-line error
        (``tollway engine`` prints ``error: ...`` for a checkpoint or setting it refuses),
        else with its log's tail."""
        code = self.process.poll()
        if code is None:
            return
        tail = self.log_tail()
        errors = [line for line in tail.splitlines() if line.startswith(_ERROR_PREFIX)]
        if errors:
            reason = errors[-1].removeprefix(_ERROR_PREFIX)
            raise EngineStartError(
                f"engine {self.spec.name!r} exited with code {code}: {reason} "
                f"(log: {self.log_path})"
            )
        raise EngineStartError(
            f"engine {self.spec.name!r} exited with code {code} (log: {self.log_path}):\n{tail}"
        )

    def signal(self, signum: int) -> None:
        if self.is_running():
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signum)

    def wait(self, timeout_s: float) -> bool:
        """Whether the process has exited (and been reaped) within ``timeout_s``."""
        try:
            self.process.wait(timeout=max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            return False
        return True

    def close_log(self) -> None:
        if not self._log.closed:
            self._log.close()


class EngineSupervisor:
    """Starts a set of engines, waits for their health, and stops them all on exit.

    ::

        with EngineSupervisor(specs, log_dir) as engines:
            engines.wait_until_healthy(timeout_s=300)
            ...serve...
        # every engine has exited here
    """

    def __init__(
        self,
        specs: Sequence[EngineSpec],
        log_dir: Path,
        *,
        first_restart_delay_s: float = FIRST_RESTART_DELAY_S,
    ) -> None:
        self._specs = tuple(specs)
        self._log_dir = log_dir
        self._first_restart_delay_s = first_restart_delay_s
        self.engines: list[EngineProcess] = []
        self.restarts: dict[str, int] = {spec.name: 0 for spec in self._specs}
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._lock = threading.Lock()  # engines are replaced by the watchdog, stopped by stop()

    def __enter__(self) -> EngineSupervisor:
        atexit.register(self.stop)
        try:
            for spec in self._specs:
                self.engines.append(EngineProcess(spec, self._log_dir / f"{spec.name}.log"))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_until_healthy(self, timeout_s: float, poll_s: float = 0.1) -> None:
        """Return once every engine is ready (``/ready``: its model loaded; ``/health``
        answers earlier); raise `EngineStartError` otherwise."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.engines)
        while pending:
            for engine in list(pending):
                engine.check_alive()
                if is_socket_ready(engine.spec.socket_path):
                    pending.remove(engine)
            if not pending:
                return
            if time.monotonic() > deadline:
                engine = pending[0]
                raise EngineStartError(
                    f"engine {engine.spec.name!r} was not ready within {timeout_s:.0f} s "
                    f"(log: {engine.log_path}):\n{engine.log_tail()}"
                )
            time.sleep(poll_s)

    def watch(self, poll_s: float = 0.5) -> None:
        """Restart engines that exit on their own, from a daemon thread, until ``stop()``."""
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, args=(poll_s,), name="engine-watchdog", daemon=True
            )
            self._watchdog.start()

    def _watch(self, poll_s: float) -> None:
        delays = {spec.name: self._first_restart_delay_s for spec in self._specs}
        while not self._stopping.wait(poll_s):
            for index, engine in enumerate(list(self.engines)):
                if engine.is_running():
                    if time.monotonic() - engine.started_at > STABLE_UPTIME_S:
                        delays[engine.spec.name] = self._first_restart_delay_s
                    continue
                name = engine.spec.name
                logger.error(
                    "engine %r exited with code %s; restarting it in %.0f s (log: %s):\n%s",
                    name,
                    engine.process.returncode,
                    delays[name],
                    engine.log_path,
                    engine.log_tail(),
                )
                if self._stopping.wait(delays[name]):
                    return
                delays[name] = min(delays[name] * 2, MAX_RESTART_DELAY_S)
                self._restart(index, engine)

    def _restart(self, index: int, engine: EngineProcess) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            engine.close_log()
            try:
                replacement = EngineProcess(engine.spec, engine.log_path, append_log=True)
            except (OSError, EngineStartError) as error:
                logger.error("engine %r could not be restarted: %s", engine.spec.name, error)
                return
            self.engines[index] = replacement
            self.restarts[engine.spec.name] += 1
        logger.warning("engine %r restarted (pid %d)", engine.spec.name, replacement.pid)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every engine, wait up to ``grace_s`` in all, then SIGKILL the rest."""
        self._stopping.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=grace_s)
        with self._lock:
            self._stop_engines(grace_s)
        atexit.unregister(self.stop)

    def _stop_engines(self, grace_s: float) -> None:
        for engine in self.engines:
            engine.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for engine in self.engines:
            if not engine.wait(deadline - time.monotonic()):
                engine.signal(signal.SIGKILL)
                engine.wait(5.0)
            engine.close_log()
