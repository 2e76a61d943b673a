"""A 1 MiB prompt made of one word never stalls the gateway's event loop.

The gateway runs in its own process (as ``tollway serve`` runs it: uvloop, httptools), in
front of the tiny engines. While long prompts arrive on both endpoints, for a plain model and
for ``auto``, another client polls ``/health``: its p99 must stay under 100 ms. Before, the
routing heuristics backtracked quadratically on one long word (16 k characters blocked every
request for about 10 s) and completions prompts were tokenized on the event loop.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.stand_in_stack import tenant_key

from .conftest import CONTEXT_WINDOW, LARGE, SMALL, Engines

ONE_MIB = 1 << 20
HEALTH_P99_S = 0.100
_SERVE = """
import json, sys
import uvicorn
from gateway.app import build_gateway
from gateway.settings import GatewaySettings
settings = GatewaySettings.from_dict(json.loads(sys.argv[1]))
uvicorn.run(build_gateway(settings), host="127.0.0.1", port=int(sys.argv[2]), loop="uvloop",
            http="httptools", lifespan="on", log_level="warning")
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def gateway_process(
    request: pytest.FixtureRequest, engines: Engines, db_url: str, tmp_path: Path
) -> Iterator[str]:
    """A gateway process whose models have ``request.param`` tokens of context."""
    data = {
        "data_dir": str(tmp_path / "gw"),
        "database_url": db_url,
        "max_body_bytes": 2 * ONE_MIB,  # room for a 1 MiB prompt and its JSON
        "models": {
            name: {
                "upstreams": [f"unix:{path}"],
                "context_window": request.param,
                "checkpoint": str(engines.checkpoint),
            }
            for name, path in engines.sockets.items()
        },
        "routing": {"aliases": {"auto": {"small": SMALL, "large": LARGE}}},
    }
    port = _free_port()
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE, json.dumps(data), str(port)], cwd=repo, env=env
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, "the gateway exited"
            assert time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.1)
        yield base
    finally:
        process.kill()
        process.wait(timeout=30)


# The poller is a process of its own: this one also runs the engines, whose tokenizer holds
# the GIL while it encodes 1 MiB. It says "polling" once its first poll is answered, polls
# until its stdin closes, then prints its latencies.
_POLL = """
import json, sys, threading, time
import httpx
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
latencies = []
with httpx.Client(base_url=sys.argv[1], timeout=5) as client:
    while not stop.is_set():
        started = time.perf_counter()
        try:
            client.get("/health")
        except httpx.TimeoutException:
            pass  # counted as the time it took
        latencies.append(time.perf_counter() - started)
        if len(latencies) == 1:
            print("polling", flush=True)
        time.sleep(0.002)
print(json.dumps(latencies))
"""


@pytest.mark.parametrize(
    ("gateway_process", "num_rounds"),
    [(CONTEXT_WINDOW, 40), (4 * ONE_MIB, 2)],
    ids=["refused-by-length", "tokenized"],
    indirect=["gateway_process"],
)
def test_one_mib_words_leave_health_fast(
    gateway_process: str, db_url: str, num_rounds: int
) -> None:
    """Refused by length: each prompt is longer than 2048 tokens by its length alone and is
    not tokenized. Tokenized: the gateway's windows hold it, so it is counted (off the event
    loop) and forwarded; the engine (2048 tokens) refuses it."""
    _, key = tenant_key(db_url)
    word = "a" * ONE_MIB
    requests = [
        (path, {"model": model, **prompt})
        for model in (SMALL, "auto")
        for path, prompt in (
            ("/v1/completions", {"prompt": word}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": word}]}),
        )
    ]
    headers = {"authorization": f"Bearer {key}"}
    answers = []
    with httpx.Client(base_url=gateway_process, headers=headers, timeout=30) as client:
        for path, body in requests:  # a warm gateway: first-use costs are not what is measured
            short = json.loads(json.dumps(body).replace(word, "Hello"))
            assert client.post(path, json={**short, "max_tokens": 1}).status_code == 200
        poller = subprocess.Popen(
            [sys.executable, "-c", _POLL, gateway_process],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert poller.stdout is not None
            assert poller.stdout.readline() == "polling\n"  # it has started polling
            for _ in range(num_rounds):
                for path, body in requests:
                    try:
                        answers.append(client.post(path, json=body))
                    except httpx.TimeoutException:
                        pytest.fail(f"{path} on {body['model']}: no answer in 30 s")
        finally:
            out, _ = poller.communicate(timeout=30)  # closes its stdin: it stops
    latencies = sorted(json.loads(out))

    for answer in answers:
        assert answer.status_code == 400, answer.text
    assert len(latencies) >= 100
    p99 = latencies[int(len(latencies) * 0.99)]
    assert p99 < HEALTH_P99_S, f"/health p99 {p99 * 1000:.0f} ms over {len(latencies)} polls"
