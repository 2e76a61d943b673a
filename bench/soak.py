"""Soak: mixed traffic through the gateway for a set time; does its memory (or an engine's) grow?

The stack is `bench.gateway_stack`'s (gateway, redis-server, engines, all on loopback or unix
sockets): models ``small`` and ``large``, each an instant stand-in engine (``--engine
stand-in``) or, with ``--engine real``, ``small`` served by a real CPU engine on a demo
checkpoint; alias ``auto`` routes between them. Clients (``--concurrency`` of them, in this
process) send, for ``--seconds``, a seeded mix of

- chat and completions, streamed and not, on ``small``, ``large`` and ``auto``, from several
  tenants with two keys each, every prompt different;
- refusals: a tenant over its rate limit (429), a tenant asking for a model it may not use
  (403), an unknown key (401), a body that is not JSON (400), an unknown model (404);
- clients that leave: a stream dropped after its first chunk, a request dropped before its
  answer.

Every half second it samples the RSS of the gateway, the engines and redis-server against
the number of requests answered. After ``--warm-up`` requests it reports the RSS at every
10,000 requests and the slope of a least-squares line through every sample since the warm-up,
in MiB per 10,000 requests (the target: under 1). An answer the mix does not expect (any 5xx
above all) is counted and reported.

``--probe DIR`` takes a reading inside each server (`bench.memory_probe`) at the end of the
warm-up (or a third of the way, if sooner) and at the end, and prints what grew in between:
RSS, glibc malloc's bytes in use and held free, object counts by type and, with tracemalloc
on (``--probe-frames``, 1 by default; it makes the servers several times slower), the
Python source lines that allocated.

    python -m bench.soak --seconds 120                  # budgets and rate limits in Redis
    python -m bench.soak --seconds 120 --store memory   # in process, as `tollway serve`
    MALLOC_ARENA_MAX=2 python -m bench.soak --seconds 120     # glibc arenas, for comparison
    python -m bench.soak --engine real --seconds 60 --concurrency 100 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway_stack import EngineSpec, Stack, gateway_stack
from bench.memory_probe import FRAMES_ENV, PROBE_DIR_ENV, compare
from bench.workloads import command_line, demo_model
from tests.support.polling import wait_until

MODELS = ("small", "large", "auto")
ROUTING = {"aliases": {"auto": {"small": "small", "large": "large"}}, "long_prompt_tokens": 64}
SAMPLE_EVERY_S = 0.5
PER_10K = 10_000
WORDS = (
    *("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"),
    *("juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo"),
    *("sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu", "budget"),
    *("tenant", "stream", "token", "gateway", "engine", "cache", "block", "prefix", "route"),
    *("quota", "ledger", "replica"),
)

# kind -> (weight, the statuses it may get; 0: the client left before any status)
KINDS: dict[str, tuple[int, frozenset[int]]] = {
    "chat": (20, frozenset({200})),
    "chat_stream": (25, frozenset({200})),
    "completion": (14, frozenset({200})),
    "completion_stream": (14, frozenset({200})),
    "over_rate_limit": (4, frozenset({200, 429})),
    "model_not_allowed": (4, frozenset({403})),
    "unknown_key": (3, frozenset({401})),
    "bad_json": (3, frozenset({400})),
    "unknown_model": (3, frozenset({404})),
    "leave_stream": (5, frozenset({200})),
    "leave_before_answer": (5, frozenset({0, 200})),
}


@dataclass(frozen=True)
class Keys:
    open: list[str]  # tenants without limits, two keys each
    limited: str  # rpm 30: mostly 429s
    small_only: str  # allowed_models: small


@dataclass
class Tally:
    num_done: int = 0
    by_kind: Counter[tuple[str, int]] = field(default_factory=Counter)
    unexpected: Counter[tuple[str, int]] = field(default_factory=Counter)


@dataclass(frozen=True)
class Sample:
    num_requests: int
    elapsed_s: float
    rss_mib: dict[str, float]  # process label -> RSS


# --- tenants -----------------------------------------------------------------------------------


def make_keys(database_url: str, num_open_tenants: int) -> Keys:
    from gateway.storage.api_keys import create_key
    from gateway.storage.database import Database
    from gateway.storage.tenants import create_tenant

    unlimited = {"budget_tokens": 10**15, "rpm": 10**9, "tpm": 10**15}
    database = Database(database_url)
    try:
        with database.transaction() as session:
            keys = []
            for i in range(num_open_tenants):
                tenant = f"soak-{i}"
                create_tenant(session, tenant, name=tenant, tier="standard", quota=unlimited)
                keys += [create_key(session, tenant, name=f"k{j}").key for j in range(2)]
            create_tenant(session, "limited", name="limited", tier="free", quota={"rpm": 30})
            small = {**unlimited, "allowed_models": ["small"]}
            create_tenant(session, "small-only", name="small-only", tier="free", quota=small)
            return Keys(
                keys, create_key(session, "limited").key, create_key(session, "small-only").key
            )
    finally:
        database.dispose()


# --- load --------------------------------------------------------------------------------------


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(4, 120)))


def request_for(
    kind: str, rng: random.Random, keys: Keys, max_tokens: int
) -> tuple[str, str, bytes]:
    """``(path, key, body)`` for one request of ``kind``."""
    is_completion = kind.startswith("completion") or (
        kind.startswith("leave") and rng.random() < 0.5
    )
    model = rng.choice(MODELS)
    key = rng.choice(keys.open)
    if kind == "over_rate_limit":
        key = keys.limited
    elif kind == "model_not_allowed":
        key, model = keys.small_only, "large"
    elif kind == "unknown_key":
        key = "sk-" + "".join(rng.choices("0123456789abcdef", k=48))
    elif kind == "unknown_model":
        model = f"no-such-model-{rng.randrange(10**6)}"
    is_stream = kind.endswith("stream") or (kind == "over_rate_limit" and rng.random() < 0.5)
    body: dict[str, object] = {"model": model, "max_tokens": max_tokens, "stream": is_stream}
    if is_completion:
        path, body["prompt"] = "/v1/completions", prompt(rng)
    else:
        path = "/v1/chat/completions"
        body["messages"] = [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": prompt(rng)},
        ]
    if kind == "bad_json":
        return path, key, json.dumps(body).encode()[:-7]
    return path, key, json.dumps(body).encode()


async def one_request(
    session: aiohttp.ClientSession, url: str, kind: str, key: str, body: bytes
) -> int:
    """The status the client saw (0: it left before one came)."""
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    if kind == "leave_before_answer":

        async def answer() -> int:
            async with session.post(url, data=body, headers=headers) as response:
                await response.read()
                return response.status

        try:
            return await asyncio.wait_for(answer(), 0.001)
        except asyncio.TimeoutError:  # not TimeoutError before Python 3.11
            return 0
    async with session.post(url, data=body, headers=headers) as response:
        if kind == "leave_stream" and response.status == 200:
            await response.content.readany()
            response.close()  # gone after the first chunk
            return response.status
        data = await response.read()
        if response.status == 200 and not (data.endswith(b"[DONE]\n\n") or b'"usage"' in data):
            return -1  # an answer cut short
        return response.status


async def drive(
    stack: Stack, keys: Keys, args: argparse.Namespace, tally: Tally, stop_at: float
) -> None:
    rng = random.Random(args.seed)
    kinds, weights = list(KINDS), [w for w, _ in KINDS.values()]
    connector = aiohttp.TCPConnector(limit=args.concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while time.monotonic() < stop_at:
                kind = rng.choices(kinds, weights)[0]
                path, key, body = request_for(kind, rng, keys, args.max_tokens)
                try:
                    status = await one_request(session, stack.gateway_url + path, kind, key, body)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    status = -2  # the connection failed
                tally.num_done += 1
                tally.by_kind[kind, status] += 1
                if status not in KINDS[kind][1]:
                    tally.unexpected[kind, status] += 1

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))


async def sample_memory(
    processes: dict[str, psutil.Process], tally: Tally, samples: list[Sample], stop_at: float
) -> None:
    start = time.monotonic()
    while time.monotonic() < stop_at:
        rss = {name: p.memory_info().rss / 2**20 for name, p in processes.items()}
        samples.append(Sample(tally.num_done, time.monotonic() - start, rss))
        await asyncio.sleep(SAMPLE_EVERY_S)


# --- probe -------------------------------------------------------------------------------------


def take_readings(pids: dict[str, int], probe_dir: Path) -> dict[str, Path]:
    """SIGUSR1 to each process; waits for its reading; the stems, by process label."""
    before = {name: set(probe_dir.glob(f"*-{pid}-*.json")) for name, pid in pids.items()}
    for pid in pids.values():
        os.kill(pid, signal.SIGUSR1)

    def new_readings(name: str, pid: int) -> set[Path]:
        return set(probe_dir.glob(f"*-{pid}-*.json")) - before[name]

    stems = {}
    for name, pid in pids.items():
        what = f"a memory reading from {name} ({pid})"
        wait_until(lambda name=name, pid=pid: new_readings(name, pid), 120, what)
        stems[name] = Path(str(new_readings(name, pid).pop()).removesuffix(".json"))
    return stems


# --- report ------------------------------------------------------------------------------------


def slope_per_10k(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(requests, MiB)`` points, in MiB per 10,000 requests."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    return cov / var * PER_10K if var else 0.0


def report(samples: list[Sample], tally: Tally, args: argparse.Namespace, elapsed_s: float) -> None:
    print(f"command: {command_line()}")
    arenas = os.environ.get("MALLOC_ARENA_MAX", "glibc's default")
    print(
        f"{tally.num_done} requests in {elapsed_s:.0f} s ({tally.num_done / elapsed_s:.0f}/s), "
        f"{args.concurrency} clients, engine {args.engine}, max_tokens {args.max_tokens}, "
        f"budgets and rate limits in {args.store}; "
        f"{os.cpu_count()} CPUs shared by everything; MALLOC_ARENA_MAX {arenas}"
        + ("; tracemalloc on (--probe)" if args.probe and args.probe_frames > 0 else "")
    )
    outcomes = ", ".join(
        f"{kind} {status}: {n}" for (kind, status), n in sorted(tally.by_kind.items())
    )
    print(f"outcomes (kind status: count; 0 = client left first): {outcomes}")
    if tally.unexpected:
        print(f"UNEXPECTED answers: {dict(tally.unexpected)}")
    else:
        print("unexpected answers: none (no 5xx)")
    after = [s for s in samples if s.num_requests >= args.warm_up]
    names = list(samples[0].rss_mib)
    print(
        f"\nRSS (MiB) per {PER_10K:,} requests, or per tenth of the run if that is too few "
        f"(warm-up: the first {args.warm_up:,}):"
    )
    print(f"  {'requests':>9}  {'time':>6}  " + "  ".join(f"{n:>10}" for n in names))
    marks = [0, *range(args.warm_up, samples[-1].num_requests + 1, PER_10K)]
    if len(marks) < 6:  # a slow engine: every tenth of the run instead
        marks = sorted({samples[i * (len(samples) - 1) // 10].num_requests for i in range(10)})
    for mark in marks:
        sample = next((s for s in samples if s.num_requests >= mark), None)
        if sample is not None:
            print(
                f"  {sample.num_requests:>9}  {sample.elapsed_s:>5.0f}s  "
                + "  ".join(f"{sample.rss_mib[n]:>10.1f}" for n in names)
            )
    last = samples[-1]
    print(
        f"  {last.num_requests:>9}  {last.elapsed_s:>5.0f}s  "
        + "  ".join(f"{last.rss_mib[n]:>10.1f}" for n in names)
        + "  (end)"
    )
    if len(after) < 10 or after[-1].num_requests - after[0].num_requests < PER_10K // 10:
        print("\nslope: too few requests after the warm-up; run longer or lower --warm-up")
        return
    span = after[-1].num_requests - after[0].num_requests
    print(
        f"\nslope after the warm-up (least squares over {len(after)} samples, {span:,} "
        f"requests), MiB per {PER_10K:,} requests (target < 1):"
    )
    for name in names:
        value = slope_per_10k([(s.num_requests, s.rss_mib[name]) for s in after])
        growth = after[-1].rss_mib[name] - after[0].rss_mib[name]
        print(f"  {name:<10} {value:+7.3f}   (first to last sample {growth:+.1f} MiB)")


# --- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="how long to send")
    parser.add_argument("--concurrency", type=int, default=32, help="clients in flight")
    parser.add_argument("--warm-up", type=int, default=10_000, help="requests before fitting")
    parser.add_argument("--engine", choices=("stand-in", "real"), default="stand-in")
    parser.add_argument("--size", default="small", help="demo checkpoint size (--engine real)")
    parser.add_argument("--num-chunks", type=int, default=8, help="stand-in content chunks")
    parser.add_argument("--itl-ms", type=float, default=0.0, help="stand-in pacing per chunk")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-tenants", type=int, default=6, help="unlimited tenants")
    parser.add_argument(
        "--store",
        choices=("redis", "memory"),
        default="redis",
        help="where the gateway keeps budgets and rate limits (memory: `tollway serve`'s default)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe", help="directory for tracemalloc/gc/malloc readings")
    parser.add_argument(
        "--probe-frames",
        type=int,
        default=1,
        help="tracemalloc frames per allocation with --probe (0: no tracemalloc, full speed)",
    )
    args = parser.parse_args()

    small = EngineSpec("small", args.num_chunks, itl_ms=args.itl_ms)
    if args.engine == "real":
        small = EngineSpec("small", 0, checkpoint=demo_model(args.size, None))
    engines = [small, EngineSpec("large", args.num_chunks, itl_ms=args.itl_ms)]
    probe_dir = Path(args.probe or tempfile.mkdtemp(prefix="tw-soak-probe-")).resolve()
    if args.probe:
        probe_dir.mkdir(parents=True, exist_ok=True)
        os.environ[PROBE_DIR_ENV] = str(probe_dir)  # the spawned servers inherit them
        os.environ[FRAMES_ENV] = str(args.probe_frames)
    overrides: dict[str, Any] = {"routing": ROUTING}
    if args.store == "memory":
        overrides["redis_url"] = None
    with gateway_stack(engines, gateway_settings=overrides) as stack:
        keys = make_keys(stack.database_url, args.num_tenants)
        pids = {
            "gateway": stack.gateway_pid,
            **{f"engine:{m}": p for m, p in stack.engine_pids.items()},
        }
        if args.engine == "stand-in":
            pids.pop("engine:large")
        processes = {name: psutil.Process(pid) for name, pid in pids.items()}
        processes["redis"] = psutil.Process(stack.redis_pid)
        tally, samples = Tally(), []
        readings: list[dict[str, Path]] = []

        async def run() -> float:
            start = time.monotonic()
            stop_at = start + args.seconds
            sampler = asyncio.create_task(sample_memory(processes, tally, samples, stop_at))
            load = asyncio.create_task(drive(stack, keys, args, tally, stop_at))
            if args.probe:  # tracemalloc slows the servers: the warm-up may not end in time
                first_at = start + args.seconds / 3
                while tally.num_done < args.warm_up and time.monotonic() < first_at:  # noqa: ASYNC110 (a deadline too)
                    await asyncio.sleep(0.2)
                readings.append(await asyncio.to_thread(take_readings, pids, probe_dir))
            await load
            await sampler
            return time.monotonic() - start

        elapsed_s = asyncio.run(run())
        if args.probe:
            readings.append(take_readings(pids, probe_dir))
    report(samples, tally, args, elapsed_s)
    if len(readings) == 2:
        for name in pids:
            print(f"\n{name}: from the end of the warm-up to the end")
            print("\n".join(compare(readings[0][name], readings[1][name])))


if __name__ == "__main__":
    main()
