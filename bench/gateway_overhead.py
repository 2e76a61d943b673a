"""Gateway overhead: the same load straight to a stand-in engine and through the gateway
(budgets and rate limits in Redis, keys in SQLite), side by side in one run, in two scenarios.

- **instant engine** (capacity): the engine answers at once, so the load is limited by the
  gateway itself. This measures its requests/s and CPU per request. At 32-128 requests in
  flight every process runs flat out, and the added latency there is queueing, not overhead.
- **paced engine** (added latency): the engine takes as long as a real one (by default 50 ms
  to the first token, then 20 ms per token, 32 tokens: ~0.7 s per answer), so 32-128 in
  flight is a realistic load well below the gateway's capacity, and "added" is what the
  gateway adds to each request. Its clients start spread over one answer time: all started
  at once, they would stay in step (every answer takes the same time) and the gateway would
  see bursts of 32-128 requests at once, one burst per answer time (`--paced-lockstep`).

    python -m bench.gateway_overhead                       # both scenarios
    python -m bench.gateway_overhead --repeats 3 --concurrency 1 32 128
    python -m bench.gateway_overhead --scenarios paced --paced-itl-ms 10
    python -m bench.gateway_overhead --profile /tmp/gw.prof   # CPU profile of the gateway's loop
    python -m bench.gateway_overhead --budget-levels 3   # also: three budget levels against one

``--budget-levels 3`` adds an arm: the same load through the same gateway with a key of a
second tenant whose requests must fit three budgets (the tenant's tokens, the key's money,
the end user's tokens: three balances reserved in the one admission script) instead of the
tenant's alone; each case runs the two arms back to back and reports their ratio (target:
within 5%). Every request names an end user (``user``) in both arms, so the one-level arm
is the hot path of a tenant with no budgets below it.

Six processes share the machine (`bench.gateway_stack`): this one (the aiohttp load
generator), two stand-in engines (`tests.support.stand_in_engine`, instant and paced; the gateway
serves them as two models), the gateway (uvicorn, one worker, uvloop + httptools),
redis-server, and the floor proxy (`bench.floor_proxy`, served the same way: body parsed
for the model, one Lua script in Redis, aiohttp to the engine, nothing else). Each case
runs direct, through the floor proxy, then through the gateway. Latency is per request, to
the last byte (and to the first byte for streams); "added" is gateway (or floor proxy)
minus direct: the floor proxy's is what this stack and machine cost before any of the
gateway's own work. CPU per request is the gateway process's user + system time (all its
threads, and its event-loop thread alone) over the requests it served, read from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway_stack import EngineSpec, Stack, cpu_sample, gateway_stack
from bench.workloads import command_line
from tests.support.stand_in_engine import MODEL

# Developer notes: LiteLLM's proxy, one worker, in front of an instant stand-in engine.
LITELLM_RPS = {False: 118.0, True: 45.0}
LITELLM_CPU_MS = {False: 7.0, True: 21.0}
TARGET_ADDED_P50_MS, TARGET_ADDED_P99_MS, TARGET_SPEEDUP = 1.0, 5.0, 10.0
TARGET_THREE_LEVELS = 0.05  # three budget levels cost at most 5% more than one
BENCH_USER = "bench-user"


@dataclass(frozen=True)
class Scenario:
    name: str
    engine: EngineSpec
    num_requests: int  # per case and way, after a warm-up
    max_tokens: int
    is_capacity: bool  # instant engine: compared with LiteLLM, >= 10x its req/s a target
    is_spread: bool  # clients start spread over one answer time, not all at once

    @property
    def answer_s(self) -> float:
        e = self.engine
        return (e.ttft_ms + max(e.num_chunks - 1, 0) * e.itl_ms) / 1000

    @property
    def spread_s(self) -> float:
        return self.answer_s if self.is_spread else 0.0

    def header(self) -> str:
        e = self.engine
        starts = (
            f"clients start spread over {self.spread_s * 1000:.0f} ms"
            if self.is_spread
            else "clients start at once"
        )
        if self.is_capacity:
            what = (
                "capacity: requests/s and gateway CPU per request (every process runs flat "
                "out, so added latency here is queueing)"
            )
            pacing = f"answers at once, {e.num_chunks} content chunks"
        else:
            what = "the latency the gateway adds at realistic engine speed"
            pacing = (
                f"{e.ttft_ms:g} ms to the first content, then {e.itl_ms:g} ms per chunk, "
                f"{e.num_chunks} content chunks ({self.answer_s * 1000:.0f} ms per answer)"
            )
        return (
            f"== {self.name} engine (model {e.model!r}), measures {what} ==\n"
            f"stand-in engine: {pacing}; max_tokens {self.max_tokens}; "
            f"{self.num_requests} requests per case and way; {starts}"
        )


@dataclass(frozen=True)
class LoadResult:
    latencies_ms: list[float]  # to the last byte
    ttfb_ms: list[float]  # to the first body byte (streams only)
    elapsed_s: float
    cpu_s: float  # gateway process CPU while this load ran, all threads (0 for direct loads)
    loop_cpu_s: float  # of which its main (event loop) thread
    redis_cpu_s: float

    @property
    def rps(self) -> float:
        return len(self.latencies_ms) / self.elapsed_s


# --- load --------------------------------------------------------------------------------------


def request_body(model: str, is_stream: bool, max_tokens: int) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello to the benchmark in a few words."}],
        "max_tokens": max_tokens,
        "stream": is_stream,
        "user": BENCH_USER,  # the three-level arm's end user; no budget of its own otherwise
    }
    if is_stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


async def run_load(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    num_requests: int,
    concurrency: int,
    is_stream: bool,
    spread_s: float = 0.0,
) -> tuple[list[float], list[float], float]:
    """``(latencies_ms, ttfb_ms, elapsed_s)``; raises on any answer that is not a full 200.

    Client ``i`` of ``concurrency`` sends its first request ``i * spread_s / concurrency`` in.
    Against an engine that always takes the same time, clients that all start at once stay
    in step: the gateway then sees bursts of ``concurrency`` requests, one per answer time,
    and mostly measures its queue during each burst."""
    latencies: list[float] = []
    ttfbs: list[float] = []
    remaining = num_requests

    async def one() -> None:
        start = time.perf_counter()
        async with session.post(url, data=body) as response:
            if is_stream:
                first, tail = 0.0, b""
                async for data in response.content.iter_any():
                    first = first or time.perf_counter()
                    tail = (tail + data)[-16:]
                is_complete = tail.endswith(b"data: [DONE]\n\n")
            else:
                data = await response.read()
                is_complete = b'"usage"' in data
        end = time.perf_counter()
        if response.status != 200 or not is_complete:
            raise RuntimeError(f"{url}: status {response.status}, incomplete answer")
        latencies.append((end - start) * 1000)
        if is_stream:
            ttfbs.append((first - start) * 1000)

    async def worker(i: int) -> None:
        nonlocal remaining
        await asyncio.sleep(i * spread_s / concurrency)
        while remaining > 0:
            remaining -= 1
            await one()

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return latencies, ttfbs, time.perf_counter() - start


async def measure(
    url: str,
    headers: dict[str, str],
    body: bytes,
    is_stream: bool,
    concurrency: int,
    num_requests: int,
    spread_s: float,
    pids: tuple[int, int] | None,
) -> LoadResult:
    """One load against ``url`` after a warm-up; ``pids`` (gateway, redis) to charge CPU to."""
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout) as s:
        num_warm_up = max(4 * concurrency, 200)
        await run_load(s, url, body, num_warm_up, concurrency, is_stream, spread_s)
        before = cpu_sample(pids)
        latencies, ttfbs, elapsed = await run_load(
            s, url, body, num_requests, concurrency, is_stream, spread_s
        )
        cpu, loop_cpu, redis_cpu = (b - a for a, b in zip(before, cpu_sample(pids), strict=True))
    return LoadResult(latencies, ttfbs, elapsed, cpu, loop_cpu, redis_cpu)


# --- report ------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def med(results: list[LoadResult], stat: Callable[[LoadResult], float]) -> float:
    return statistics.median(stat(r) for r in results)


def p50_p99(results: list[LoadResult], is_first_byte: bool = False) -> tuple[float, float]:
    """Median over repeats of each run's p50 and p99 (ms)."""

    def values(r: LoadResult) -> list[float]:
        return r.ttfb_ms if is_first_byte else r.latencies_ms

    return med(results, lambda r: pct(values(r), 50)), med(results, lambda r: pct(values(r), 99))


def report(
    scenario: Scenario,
    is_stream: bool,
    concurrency: int,
    direct: list[LoadResult],
    floor: list[LoadResult],
    gateway: list[LoadResult],
) -> None:
    mode = "streamed" if is_stream else "non-streamed"
    num = len(gateway[0].latencies_ms)
    print(f"\n{mode}, concurrency {concurrency}, {num} requests each way:")
    for label, is_first_byte in [("last byte", False), ("first byte", True)][: 1 + is_stream]:
        d50, d99 = p50_p99(direct, is_first_byte)
        g50, g99 = p50_p99(gateway, is_first_byte)
        f50, f99 = p50_p99(floor, is_first_byte)
        print(
            f"  {label:<10}  direct p50 {d50:7.2f} ms  p99 {d99:7.2f} ms | gateway p50 "
            f"{g50:7.2f} ms  p99 {g99:7.2f} ms | added p50 {g50 - d50:+7.2f} ms  "
            f"p99 {g99 - d99:+7.2f} ms | floor proxy added p50 {f50 - d50:+6.2f} ms  "
            f"p99 {f99 - d99:+6.2f} ms"
        )
    d_rps, g_rps = med(direct, lambda r: r.rps), med(gateway, lambda r: r.rps)
    cpu_ms = med(gateway, lambda r: r.cpu_s / num * 1000)
    loop_ms = med(gateway, lambda r: r.loop_cpu_s / num * 1000)
    redis_ms = med(gateway, lambda r: r.redis_cpu_s / num * 1000)
    busy = med(gateway, lambda r: r.cpu_s / r.elapsed_s)
    runs = ", ".join(f"{r.rps:.0f}" for r in gateway)
    litellm_rps, litellm_cpu_ms = LITELLM_RPS[is_stream], LITELLM_CPU_MS[is_stream]
    versus = (
        f"{g_rps / litellm_rps:.1f}x LiteLLM's {litellm_rps:.0f}"
        if scenario.is_capacity
        else f"{g_rps / d_rps:.2f}x direct"
    )
    print(f"  requests/s  direct {d_rps:7.0f} | gateway {g_rps:7.0f} (runs: {runs}) | {versus}")
    versus = (
        f"LiteLLM {litellm_cpu_ms:.0f} ms, {litellm_cpu_ms / cpu_ms:.1f}x less; "
        if scenario.is_capacity
        else ""
    )
    print(
        f"  CPU/request gateway {cpu_ms:.2f} ms ({versus}event-loop thread {loop_ms:.2f} ms, "
        f"other threads {cpu_ms - loop_ms:.2f} ms), redis-server {redis_ms:.3f} ms; "
        f"gateway busy {busy:.0%} of a core; floor proxy "
        f"{med(floor, lambda r: r.cpu_s / num * 1000):.2f} ms, "
        f"{med(floor, lambda r: r.rps):.0f} req/s"
    )
    (d50, d99), (g50, g99) = p50_p99(direct), p50_p99(gateway)
    checks = [
        ("added p50", g50 - d50 < TARGET_ADDED_P50_MS),
        ("added p99", g99 - d99 < TARGET_ADDED_P99_MS),
    ]
    if scenario.is_capacity:
        checks.append(
            (f"req/s >= {TARGET_SPEEDUP:g}x LiteLLM", g_rps >= TARGET_SPEEDUP * litellm_rps)
        )
    f50, f99 = p50_p99(floor)
    floor_checks = [
        ("added p50", f50 - d50 < TARGET_ADDED_P50_MS),
        ("added p99", f99 - d99 < TARGET_ADDED_P99_MS),
    ]
    print(
        "  targets     "
        + ", ".join(f"{n} {'met' if ok else 'MISSED'}" for n, ok in checks)
        + " (the floor proxy: "
        + ", ".join(f"{n} {'met' if ok else 'missed'}" for n, ok in floor_checks)
        + ")"
    )


# --- main --------------------------------------------------------------------------------------


def report_budget_levels(one: list[LoadResult], three: list[LoadResult]) -> None:
    """The three-level arm against the one-level arm of the same case."""
    rps_1, rps_3 = med(one, lambda r: r.rps), med(three, lambda r: r.rps)
    num = len(one[0].latencies_ms)
    cpu_1 = med(one, lambda r: r.cpu_s / num * 1000)
    cpu_3 = med(three, lambda r: r.cpu_s / len(r.latencies_ms) * 1000)
    (p50_1, p99_1), (p50_3, p99_3) = p50_p99(one), p50_p99(three)
    slower = max(rps_1 / rps_3 - 1, cpu_3 / cpu_1 - 1)
    verdict = "met" if slower <= TARGET_THREE_LEVELS else "MISSED"
    print(
        f"  3 budget levels vs 1: requests/s {rps_3:.0f} vs {rps_1:.0f} ({rps_3 / rps_1:.3f}x), "
        f"CPU/request {cpu_3:.3f} vs {cpu_1:.3f} ms ({cpu_3 / cpu_1:.3f}x), p50 {p50_3:.2f} vs "
        f"{p50_1:.2f} ms, p99 {p99_3:.2f} vs {p99_1:.2f} ms | within "
        f"{TARGET_THREE_LEVELS:.0%} {verdict}"
    )


# (is_stream, concurrency) -> [direct, floor proxy, gateway, gateway with 3 budget levels] runs
Results = dict[
    tuple[bool, int],
    tuple[list[LoadResult], list[LoadResult], list[LoadResult], list[LoadResult]],
]


def run_scenario(
    stack: Stack,
    scenario: Scenario,
    cases: list[tuple[bool, int]],
    repeats: int,
    three_levels_key: str | None = None,
) -> Results:
    """Each case ``(is_stream, concurrency)`` straight to the scenario's engine, then through
    the floor proxy, then through the gateway (and, with ``three_levels_key``, through the
    gateway again with that key's three budget levels), ``repeats`` times."""
    model = scenario.engine.model
    headers = {"authorization": f"Bearer {stack.api_key}", "content-type": "application/json"}
    pids = (stack.gateway_pid, stack.redis_pid)
    floor_pids = (stack.floor_pid, stack.redis_pid)
    path = "/v1/chat/completions"
    results: Results = {case: ([], [], [], []) for case in cases}
    for _ in range(repeats):
        for is_stream, concurrency in cases:
            body = request_body(model, is_stream, scenario.max_tokens)
            num, spread_s = scenario.num_requests, scenario.spread_s
            load = (headers, body, is_stream, concurrency, num, spread_s)
            direct, floor, through, through_3 = results[(is_stream, concurrency)]
            direct.append(asyncio.run(measure(stack.engine_urls[model] + path, *load, None)))
            floor.append(asyncio.run(measure(stack.floor_url + path, *load, floor_pids)))
            through.append(asyncio.run(measure(stack.gateway_url + path, *load, pids)))
            if three_levels_key is not None:
                headers_3 = {**headers, "authorization": f"Bearer {three_levels_key}"}
                load_3 = (headers_3, *load[1:])
                through_3.append(asyncio.run(measure(stack.gateway_url + path, *load_3, pids)))
    return results


def make_three_level_key(database_url: str) -> str:
    """A key of a second tenant whose requests fit three budgets, none of them binding: the
    tenant's tokens (its quota, as the bench tenant's), the key's money and the end user's
    tokens."""
    from bench.gateway_stack import QUOTA
    from gateway.storage.api_keys import create_key
    from gateway.storage.database import Database
    from gateway.storage.scoped_budgets import put_budget
    from gateway.storage.tenants import create_tenant
    from policies.scoped_budgets import ScopedBudget

    database = Database(database_url)
    try:
        with database.transaction() as session:
            create_tenant(session, "bench-3", name="bench-3", tier="standard", quota=QUOTA)
            created = create_key(session, "bench-3")
            put_budget(
                session, "bench-3", ScopedBudget("key", "micros", 10**15, "month", created.info.id)
            )
            put_budget(
                session, "bench-3", ScopedBudget("user", "tokens", 10**15, "month", BENCH_USER)
            )
        return created.key
    finally:
        database.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scenarios", nargs="+", choices=("instant", "paced"), default=["instant", "paced"]
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    parser.add_argument(
        "--modes", nargs="+", choices=("plain", "stream"), default=["plain", "stream"]
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--profile", help="write the gateway process's cProfile stats here")
    instant = parser.add_argument_group("instant engine (capacity)")
    instant.add_argument("--num-requests", type=int, default=2000, help="per case and way")
    instant.add_argument("--num-chunks", type=int, default=8, help="content chunks per answer")
    instant.add_argument("--max-tokens", type=int, default=16)
    paced = parser.add_argument_group("paced engine (added latency; max_tokens = its chunks)")
    paced.add_argument("--paced-num-requests", type=int, default=1000, help="per case and way")
    paced.add_argument("--paced-num-chunks", type=int, default=32, help="content chunks")
    paced.add_argument("--paced-ttft-ms", type=float, default=50.0, help="to the first content")
    paced.add_argument("--paced-itl-ms", type=float, default=20.0, help="between content chunks")
    paced.add_argument(
        "--paced-lockstep",
        action="store_true",
        help="start all clients at once (they then stay in step: bursts of CONCURRENCY "
        "requests, one per answer time) instead of spread over one answer time",
    )
    parser.add_argument(
        "--budget-levels",
        type=int,
        choices=(1, 3),
        default=1,
        help="3: also run every case with a key whose requests fit three budgets (tenant, "
        "key, end user) and report it against the tenant's budget alone",
    )
    args = parser.parse_args()

    scenarios = [
        Scenario(
            "instant",
            EngineSpec(MODEL, args.num_chunks),
            args.num_requests,
            args.max_tokens,
            is_capacity=True,
            is_spread=False,
        ),
        Scenario(
            "paced",
            EngineSpec(
                f"{MODEL}-paced", args.paced_num_chunks, args.paced_ttft_ms, args.paced_itl_ms
            ),
            args.paced_num_requests,
            args.paced_num_chunks,
            is_capacity=False,
            is_spread=not args.paced_lockstep,
        ),
    ]
    scenarios = [s for s in scenarios if s.name in args.scenarios]
    cases = [(m == "stream", c) for m in args.modes for c in args.concurrency]
    with gateway_stack([s.engine for s in scenarios], args.profile) as stack:
        key_3 = make_three_level_key(stack.database_url) if args.budget_levels == 3 else None
        results = [run_scenario(stack, s, cases, args.repeats, key_3) for s in scenarios]

    print(f"command: {command_line()}")
    print(
        f"gateway: uvicorn, one worker, uvloop+httptools, budgets + rpm/tpm in redis-server, "
        f"keys in SQLite; {os.cpu_count()} CPUs shared by client, {len(scenarios)} stand-in "
        f"engine(s), gateway and redis; medians over {args.repeats} repeat(s)"
    )
    for scenario, scenario_results in zip(scenarios, results, strict=True):
        print(f"\n{scenario.header()}")
        for (is_stream, concurrency), runs in scenario_results.items():
            direct, floor, through, through_3 = runs
            report(scenario, is_stream, concurrency, direct, floor, through)
            if through_3:
                report_budget_levels(through, through_3)
    print(
        f"\ntargets: added p50 < {TARGET_ADDED_P50_MS:g} ms, p99 < {TARGET_ADDED_P99_MS:g} ms "
        f"(at 32-128 in flight, meaningful against the paced engine); instant engine: "
        f">= {TARGET_SPEEDUP:g}x LiteLLM's one-worker proxy "
        f"({TARGET_SPEEDUP * LITELLM_RPS[False]:.0f} req/s non-streamed, "
        f"{TARGET_SPEEDUP * LITELLM_RPS[True]:.0f} streamed)"
    )
    if args.profile:
        import pstats

        print(f"\ngateway profile ({args.profile}), top functions by own time:")
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
