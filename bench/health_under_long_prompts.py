"""/health p99 while 1 MiB one-word prompts keep arriving, against the issue's 100 ms.

    python -m bench.health_under_long_prompts                       # both modes
    python -m bench.health_under_long_prompts --modes tokenized --rounds 4

The gateway runs in its own process as `tollway serve` runs it (uvicorn, uvloop, httptools:
`bench.gateway_stack`), budgets in process, in front of two real CPU engines (``tiny`` and
``tiny-large``, the tiny demo checkpoint by default) and the ``auto`` alias over them. One
client sends 1 MiB prompts made of one word, on both endpoints, for ``tiny`` and for ``auto``,
one after another; another process polls ``/health`` (every 2 ms after each answer) from the
moment the first is sent to the moment the last is answered. Two modes:

- ``refused-by-length``: windows of 2048 tokens; each prompt is longer than that by its
  length alone and is refused without being tokenized (40 rounds of 4 prompts by default).
- ``tokenized``: windows of 4 Mi tokens; each prompt is tokenized (off the event loop) and
  forwarded, and the engine refuses it (2 rounds by default: each takes seconds).

The unit test (``tests/gateway/request_path/test_long_prompts.py``) checks the behaviour, that
these prompts are refused and that ``/health`` is answered while one is being tokenized;
this bench measures how fast, which depends on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway_stack import EngineSpec, gateway_stack
from bench.workloads import command_line, demo_model

ONE_MIB = 1 << 20
HEALTH_P99_S = 0.100  # the bound
SMALL, LARGE = "tiny", "tiny-large"
MODES = {"refused-by-length": (2048, 40), "tokenized": (4 * ONE_MIB, 2)}  # window, rounds
PATHS = ("/v1/completions", "/v1/chat/completions")

# The poller is a process of its own, so that neither this client's JSON encoding of 1 MiB
# nor anything else here holds its GIL. It says "polling" once its first poll is answered,
# polls until its stdin closes, then prints its latencies.
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


def body(path: str, model: str, text: str) -> dict[str, object]:
    if path == "/v1/completions":
        return {"model": model, "prompt": text}
    return {"model": model, "messages": [{"role": "user", "content": text}]}


def health_latencies(base_url: str, api_key: str, num_rounds: int) -> tuple[list[float], int]:
    """The /health latencies (s) while ``num_rounds`` of long prompts are sent, and how many
    of those prompts were answered 400 (all of them should be)."""
    word = "a" * ONE_MIB
    headers = {"authorization": f"Bearer {api_key}"}
    num_refused = 0
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as client:
        for model in (SMALL, "auto"):  # a warm gateway: first-use costs are not measured
            for path in PATHS:
                warm = client.post(path, json={**body(path, model, "Hello"), "max_tokens": 1})
                if warm.status_code != 200:
                    raise RuntimeError(f"warm-up {path} on {model}: {warm.status_code}")
        poller = subprocess.Popen(
            [sys.executable, "-c", _POLL, base_url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert poller.stdout is not None
            if poller.stdout.readline() != "polling\n":
                raise RuntimeError("the /health poller did not start")
            for _ in range(num_rounds):
                for model in (SMALL, "auto"):
                    for path in PATHS:
                        answer = client.post(path, json=body(path, model, word))
                        num_refused += answer.status_code == 400
        finally:
            out, _ = poller.communicate(timeout=60)  # closes its stdin: it stops
    return sorted(json.loads(out)), num_refused


def percentile(values: list[float], fraction: float) -> float:
    return values[min(len(values) - 1, int(len(values) * fraction))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--rounds", type=int, help="rounds of 4 prompts (default: per mode)")
    parser.add_argument("--model", default=None, help="a checkpoint instead of the tiny demo")
    args = parser.parse_args()

    checkpoint = demo_model("tiny", args.model)
    settings = {
        "redis_url": None,  # budgets in process, as `tollway serve` keeps them by default
        "max_body_bytes": 2 * ONE_MIB,  # room for a 1 MiB prompt and its JSON
        "routing": {"aliases": {"auto": {"small": SMALL, "large": LARGE}}},
    }
    engines = [EngineSpec(name, 0, checkpoint=checkpoint) for name in (SMALL, LARGE)]
    results = []
    for mode in args.modes:
        window, default_rounds = MODES[mode]
        num_rounds = args.rounds or default_rounds
        with gateway_stack(engines, gateway_settings=settings, context_window=window) as stack:
            latencies, num_refused = health_latencies(stack.gateway_url, stack.api_key, num_rounds)
        results.append((mode, num_rounds, latencies, num_refused))

    print(f"command: {command_line()}")
    print(f"checkpoint {checkpoint}; gateway, engines and the /health poller in own processes")
    is_met = True
    for mode, num_rounds, latencies, num_refused in results:
        p99 = percentile(latencies, 0.99)
        verdict = "met" if p99 < HEALTH_P99_S else "MISSED"
        is_met = is_met and p99 < HEALTH_P99_S and num_refused == 4 * num_rounds
        print(
            f"  {mode:17}: {4 * num_rounds} prompts of 1 MiB ({num_refused} refused with 400), "
            f"{len(latencies)} polls of /health: p50 {statistics.median(latencies) * 1000:.1f} ms, "
            f"p99 {p99 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms "
            f"(target p99 < {HEALTH_P99_S * 1000:.0f} ms: {verdict})"
        )
    sys.exit(0 if is_met else 1)


if __name__ == "__main__":
    main()
