"""llama.cpp's ``llama-server`` as a peer arm: find the binary, run it on a GGUF file, and
send it token-id prompts on its native ``/completion`` endpoint.

The binary comes from ``../shared/peers/llamacpp/build.sh`` (``$TOLLWAY_LLAMA_SERVER``
overrides where it is looked for). A bench whose binary is missing skips the arm and
says so. Fair running, as ``shared/peers/README.md`` describes: ``-t``/``-tb`` equal to
the engine's threads, one slot per concurrent request (``-np``), a context of
``slots x per-slot context``, and both flash-attention settings tried, the best one kept.

    with LlamaServer(binary, "model.gguf", slots=48, context_per_slot=768) as server:
        reply = server.complete([1, 2, 3], max_tokens=16)   # greedy, ignore_eos

A build for ``-march=native`` on a processor that lists AMX uses AMX tiles for quantized
matmuls (its "repacked" weight buffers); where the kernel does not grant the process AMX
state (this project's VMs), the server dies while warming up, of SIGILL or, in the repack
itself, SIGSEGV. So the server runs with ``--no-repack`` (its AVX-512 kernels) unless asked
for ``repack=True``; a repacking server that dies so is restarted once with
``--no-repack``, and :attr:`LlamaServer.settings` says so.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx

DEFAULT_BINARY = Path.home() / ".cache" / "tollway-peers" / "llamacpp" / "llama-server"
BINARY_VARIABLE = "TOLLWAY_LLAMA_SERVER"
_START_TIMEOUT_S = 120.0
_REQUEST_TIMEOUT_S = 600.0
# How a -march=native build dies where AMX is listed but not granted (see above), as
# Popen's return code: minus the signal.
_AMX_DEATHS = {-signal.SIGILL: "SIGILL", -signal.SIGSEGV: "SIGSEGV"}


FLASH_ATTENTION_CHOICES = {"both": (False, True), "off": (False,), "on": (True,), "skip": ()}


def add_llamacpp_args(parser: argparse.ArgumentParser) -> None:
    """--gguf and --llamacpp-fa, the same in every benchmark with a llama.cpp arm."""
    parser.add_argument(
        "--gguf", help="GGUF file for the llama.cpp arm (default: --model's, or the shipped one)"
    )
    parser.add_argument(
        "--llamacpp-fa",
        choices=tuple(FLASH_ATTENTION_CHOICES),
        default="both",
        help="llama.cpp flash-attention settings to try ('skip': no llama.cpp arm)",
    )


def llamacpp_arm(
    args: argparse.Namespace, model: str, shipped: Path | None
) -> tuple[Path | None, str | None, tuple[bool, ...]]:
    """``(binary, gguf, flash-attention settings to run)`` for a benchmark of ``model``: the
    GGUF is ``model`` itself, else ``--gguf``, else ``shipped``; no settings run when the
    binary or the file is missing, or ``--llamacpp-fa skip``."""
    gguf = model if Path(model).suffix == ".gguf" else args.gguf or (str(shipped or "") or None)
    binary = find_llama_server()
    settings = FLASH_ATTENTION_CHOICES[args.llamacpp_fa] if binary and gguf else ()
    return binary, gguf, settings


def find_llama_server() -> Path | None:
    """The ``llama-server`` binary, or ``None`` when it has not been built."""
    path = Path(os.environ.get(BINARY_VARIABLE) or DEFAULT_BINARY)
    return path if path.is_file() and os.access(path, os.X_OK) else None


def missing_binary_note() -> str:
    return (
        f"llama.cpp arm skipped: no llama-server at {DEFAULT_BINARY} (build it with "
        f"../shared/peers/llamacpp/build.sh, or set {BINARY_VARIABLE})"
    )


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    num_prompt_tokens: int  # what the server evaluated (the part not reused from its cache)
    prompt_ms: float  # the server's own prefill time
    decode_tokens_per_s: float  # the server's own decode rate (0 for a single token)


class LlamaServer:
    """One ``llama-server`` process on a free local port, stopped on exit."""

    def __init__(
        self,
        binary: Path,
        model: str,
        slots: int,
        context_per_slot: int,
        flash_attention: bool = False,
        num_threads: int = 2,
        repack: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        """``extra_args``: more flags, as given (speculative decoding's, say)."""
        self.port = _free_port()
        self.command = [
            str(binary),
            "-m",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-np",
            str(slots),
            "-c",
            str(slots * context_per_slot),
            "-t",
            str(num_threads),
            "-tb",
            str(num_threads),
            "-fa",
            "on" if flash_attention else "off",
            "--no-webui",
            *(() if repack else ("--no-repack",)),
            *extra_args,
        ]
        self.settings = f"-np {slots} -fa {'on' if flash_attention else 'off'} -t {num_threads}"
        self.settings += "" if repack else " --no-repack"
        self.settings += "".join(f" {arg}" for arg in extra_args)
        self._process: subprocess.Popen[bytes] | None = None
        # Its log goes to a file: a pipe nobody reads fills (64 KiB, a few hundred requests'
        # timing lines) and then blocks the server on its next log write.
        self._log: IO[bytes] | None = None
        self._client = httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}",
            timeout=_REQUEST_TIMEOUT_S,
            limits=httpx.Limits(max_connections=slots + 4),
        )

    def __enter__(self) -> LlamaServer:
        self._log = tempfile.TemporaryFile()
        self._process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=self._log)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            status = self._process.poll()
            if status in _AMX_DEATHS and "--no-repack" not in self.command:
                self._log.close()
                self.command.append("--no-repack")  # see the module docstring
                self.settings += f" --no-repack (AMX: {_AMX_DEATHS[status]})"
                return self.__enter__()
            if status is not None:
                self._log.seek(0)
                tail = self._log.read().decode(errors="replace")[-2000:]
                self._log.close()
                raise RuntimeError(f"llama-server exited at start ({status}): {tail}")
            try:
                if self._client.get("/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise RuntimeError(f"llama-server did not become healthy in {_START_TIMEOUT_S:.0f} s")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._client.close()
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            if self._log is not None:
                self._log.close()
            self._process = None

    @property
    def pid(self) -> int:
        """The server process's id (for its ``/proc`` readings), while it runs."""
        if self._process is None:
            raise RuntimeError("llama-server is not running")
        return self._process.pid

    def complete(
        self, prompt_token_ids: list[int], max_tokens: int, cache_prompt: bool = False
    ) -> Completion:
        """Greedy completion of exactly ``max_tokens`` tokens (end of sequence ignored)."""
        response = self._client.post(
            "/completion",
            json={
                "prompt": prompt_token_ids,
                "n_predict": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "top_k": 1,
                "cache_prompt": cache_prompt,
                "return_tokens": True,
            },
        )
        response.raise_for_status()
        body = response.json()
        timings = body.get("timings", {})
        return Completion(
            token_ids=list(body.get("tokens", [])),
            num_prompt_tokens=int(timings.get("prompt_n", body.get("tokens_evaluated", 0))),
            prompt_ms=float(timings.get("prompt_ms", 0.0)),
            decode_tokens_per_s=float(timings.get("predicted_per_second", 0.0) or 0.0),
        )

    def post_completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """The native ``/completion`` endpoint with any of its fields (``json_schema``...):
        its JSON reply. Raises ``RuntimeError`` with the server's words on an error status."""
        response = self._client.post("/completion", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"llama-server answered {response.status_code}: {response.text}")
        reply: dict[str, Any] = response.json()
        return reply


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
