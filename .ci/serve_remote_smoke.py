"""`tollway serve --config` with only a remote upstream answers a chat request.

Starts the torch-free stand-in engine (``tests/support/stand_in_engine.py``) on a free port, then
``tollway serve`` with a config whose one model points at it, in a temporary data directory;
waits for both by polling; sends one chat completion with the API key the first run prints;
checks the answer; stops both. Exit 0 on success, 1 with one line saying what failed.

    python .ci/serve_remote_smoke.py          # from the repository root, with `tollway` on PATH
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60.0
NUM_WORDS = 5  # the stand-in answers this many words, "word word ..."
STAND_IN = ("--num-chunks", str(NUM_WORDS))
API_KEY = re.compile(r"export TOLLWAY_API_KEY=(\S+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(is_ready: Callable[[], bool], what: str, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not is_ready():
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} was not ready within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.1)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def chat(base_url: str, api_key: str) -> dict[str, object]:
    body = {"model": "remote", "messages": [{"role": "user", "content": "Hello!"}]}
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"authorization": f"Bearer {api_key}", "content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer: dict[str, object] = json.loads(response.read())
    return answer


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="tollway-smoke-"))
    engine_port, gateway_port = free_port(), free_port()
    config = work / "tollway.yaml"
    config.write_text(
        "drain_delay_s: 0\n"  # its SIGTERM at the end need not wait for load balancers
        "models:\n"
        "  remote:\n"
        f"    upstreams: [http://127.0.0.1:{engine_port}]\n"
        "    context_window: 4096\n"
    )
    gateway_log = work / "gateway.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    engine = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.stand_in_engine",
            "--port",
            str(engine_port),
            *STAND_IN,
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    gateway: subprocess.Popen[str] | None = None
    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{engine_port}/health"), "the engine", engine)
        with gateway_log.open("w") as log:
            gateway = subprocess.Popen(
                [
                    *(shutil.which("tollway") or "tollway", "serve", "--config", str(config)),
                    *("--data-dir", str(work / "data"), "--port", str(gateway_port)),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
        base_url = f"http://127.0.0.1:{gateway_port}"
        wait_until(lambda: answers(f"{base_url}/health"), "tollway serve", gateway)
        wait_until(lambda: bool(API_KEY.search(gateway_log.read_text())), "the banner", gateway)
        match = API_KEY.search(gateway_log.read_text())
        assert match is not None
        answer = chat(base_url, match.group(1))
        choices = answer.get("choices")
        assert isinstance(choices, list), answer
        assert choices, answer
        content = choices[0]["message"]["content"]
        if content.split() != ["word"] * NUM_WORDS:
            raise RuntimeError(f"unexpected answer: {answer}")
        print(f"ok: tollway serve relayed the stand-in engine's answer {content!r}")
        return 0
    except (RuntimeError, AssertionError, OSError, KeyError, ValueError) as exc:
        tail = gateway_log.read_text()[-3000:] if gateway_log.exists() else ""
        print(f"gateway-only smoke check failed: {exc}\n{tail}", file=sys.stderr)
        return 1
    finally:
        if gateway is not None:
            stop(gateway)
        stop(engine)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
