"""What idling costs: one client, the same request back to back and with the machine idle
between requests, straight to an instant stand-in engine and through the gateway.

    python -m bench.gateway_idle_cost                     # gaps 0, 2, 10 and 30 ms
    python -m bench.gateway_idle_cost --gaps-ms 0 20 --num-requests 1000

The gateway-overhead bench's paced engine leaves the gateway idle between requests; this
one isolates that effect. For each gap it reports, per request: p50 latency direct and
through the gateway, the latency the gateway adds, and the CPU time the gateway (and its
event-loop thread) and redis-server spent. If the gateway's CPU per request grows with the
gap, the same work runs slower after an idle spell (caches and predictors lost to other
processes, a host that clocks an idle CPU down); that is the machine, not the request path.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway_overhead import request_body
from bench.gateway_stack import EngineSpec, cpu_sample, gateway_stack
from bench.workloads import command_line

MODEL = "stand-in"
WARM_UP = 50


async def one_client(url: str, headers: dict[str, str], num_requests: int, gap_s: float) -> float:
    """Median latency (ms) of ``num_requests`` sent one at a time, ``gap_s`` apart."""
    body = request_body(MODEL, False, 16)
    latencies = []
    async with aiohttp.ClientSession(headers=headers) as session:
        for i in range(WARM_UP + num_requests):
            if gap_s:
                await asyncio.sleep(gap_s)
            start = time.perf_counter()
            async with session.post(url, data=body) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"{url}: status {response.status}")
            if i >= WARM_UP:
                latencies.append((time.perf_counter() - start) * 1000)
    return statistics.median(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 2, 10, 30])
    parser.add_argument("--num-requests", type=int, default=500)
    args = parser.parse_args()

    rows = []
    with gateway_stack([EngineSpec(MODEL, num_chunks=8)]) as stack:
        headers = {"authorization": f"Bearer {stack.api_key}", "content-type": "application/json"}
        path = "/v1/chat/completions"
        pids = (stack.gateway_pid, stack.redis_pid)
        for gap_ms in args.gaps_ms:
            load = (headers, args.num_requests, gap_ms / 1000)
            direct = asyncio.run(one_client(stack.engine_urls[MODEL] + path, *load))
            before = cpu_sample(pids)
            through = asyncio.run(one_client(stack.gateway_url + path, *load))
            cpu, loop_cpu, redis_cpu = (
                (b - a) / (WARM_UP + args.num_requests) * 1000
                for a, b in zip(before, cpu_sample(pids), strict=True)
            )
            rows.append((gap_ms, direct, through, cpu, loop_cpu, redis_cpu))

    print(f"command: {command_line()}")
    print(
        f"one client, non-streamed, {args.num_requests} requests per gap and way (after "
        f"{WARM_UP} warm-up); instant stand-in engine; gateway with budgets in redis-server"
    )
    for gap_ms, direct, through, cpu, loop_cpu, redis_cpu in rows:
        print(
            f"  gap {gap_ms:5.1f} ms: p50 direct {direct:5.2f} ms, gateway {through:5.2f} ms, "
            f"added {through - direct:+5.2f} ms | CPU/request gateway {cpu:.2f} ms "
            f"(event loop {loop_cpu:.2f}), redis-server {redis_cpu:.3f} ms"
        )
    base = rows[0]
    for row in rows[1:]:
        print(
            f"  gap {row[0]:g} ms against gap {base[0]:g} ms: gateway CPU per request "
            f"{row[3] / base[3]:.2f}x, direct latency {row[1] / base[1]:.2f}x"
        )


if __name__ == "__main__":
    main()
