"""Faults in the one-machine cluster of `bench.cluster`, struck while its load runs (issue #16).

The cluster: engines on their own loopback addresses and one port behind one DNS name (a
hosts file the gateways resolve, standing in for a Kubernetes headless Service), two gateway
replicas, Redis and PostgreSQL; replicas chosen by ``prefix``. The load is `bench.cluster`'s
(tenants with long system prompts, conversations that extend their own history), every
request streamed with logprobs (one entry a token: the client counts exactly what it got).
A client retries a turn that got no token yet (a 503, or its gateway gone) on the other
gateway after ``RETRY_PAUSE_S``, as a real client would. The faults, at fractions of the
schedule (the last conversation's start):

    20%  SIGKILL engine 0 while it generates; it starts again at once on its address and
         rejoins the DNS name once ready
    50%  SIGKILL gateway 1 (its clients move to gateway 0)
    60%  SIGKILL Redis; it starts again 1 s later, from its append-only file (as deploy/ runs
         it, fsync on every write here), or empty (``--redis-without-aof``)
    70%  engine 4 (the spare, loaded before the load began) joins the DNS name
    85%  gateway 1 starts again on its data directory (its spilled records go in first)

Then checked and printed (``OK`` or ``FAILED`` each):

- no answer was a 500, and every refusal was a clean 503 in OpenAI's format;
- each stream cut by an engine's death ended with an error event and is billed exactly the
  tokens its client received; streams cut by the gateway's death are counted (unbilled:
  their gateway died with them);
- every other request a client got a request id for has its usage record;
- once reservations lapse, each tenant's budget ledger charges what its records charge;
- engine 0 served requests after its restart, and the added engine after it joined.

    python -m bench.cluster_faults
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp

from bench.cluster import (
    MODEL,
    Engine,
    add_workload_args,
    context_window,
    converse,
    engine_counters,
    make_tenant_keys,
    make_workload,
    start_engine,
    stop_engines,
    wait_ready,
)
from bench.gateway_stack import serve_gateway, tcp_socket
from bench.workloads import command_line, demo_model
from tests.support.child_process import child_process, wait_http
from tests.support.gateway_process import write_hosts_file
from tests.support.postgres_server import postgres_server
from tests.support.redis_server import RedisServer

HOST_NAME = "engines.cluster"
FIRST_ADDRESS = 2  # engine i listens on 127.0.0.(2 + i)
RETRY_PAUSE_S = 0.3
MAX_ATTEMPTS = 8
RESERVATION_TTL_S = 8.0


@dataclass
class Attempt:
    """One HTTP request of one turn, as its client saw it."""

    gateway: int
    status: int | None = None  # None: no answer (the gateway was gone)
    request_id: str | None = None
    error_code: str | None = None  # of a refusal, or of an error event mid-stream
    num_tokens: int = 0
    is_done: bool = False  # [DONE] came
    was_cut: bool = False  # the connection broke mid-stream

    @property
    def ended_by_error_event(self) -> bool:
        return self.status == 200 and self.error_code is not None


@dataclass
class Load:
    attempts: list[Attempt] = field(default_factory=list)
    gateway_alive: list[bool] = field(default_factory=lambda: [True, True])
    turn: int = 0

    def next_gateway(self) -> int:
        live = [i for i, alive in enumerate(self.gateway_alive) if alive] or [0, 1]
        self.turn += 1
        return live[self.turn % len(live)]


def address(engine: int) -> str:
    return f"127.0.0.{FIRST_ADDRESS + engine}"


class Cluster:
    """The processes, and the faults struck at them."""

    def __init__(self, args: argparse.Namespace, tmp: Path, checkpoint: str) -> None:
        self.args, self.tmp, self.checkpoint = args, tmp, checkpoint
        sock = tcp_socket()
        self.port = sock.getsockname()[1]
        sock.close()
        self.hosts_file = tmp / "hosts.json"
        self.engines: list[Engine | None] = [None] * (args.replicas + 1)
        self.redis = RedisServer(str(tmp), append_only=not args.redis_without_aof)
        self.gateway_urls: list[str] = []
        self._gateway_sockets: list[Any] = []
        self._gateway_stops: list[Any] = []
        self.settings: dict[str, Any] = {}
        self._joined: set[int] = set()

    def start_engine(self, index: int) -> Engine:
        log = self.tmp / f"engine{index}.log"
        engine = start_engine(self.checkpoint, address(index), self.port, self.args.kv_blocks, log)
        wait_ready(engine, log)
        self.engines[index] = engine
        return engine

    def publish(self, *, joined: int | None = None) -> None:
        """The DNS name lists every running engine (a ready pod) but the one not joined yet."""
        live = [
            address(i)
            for i, engine in enumerate(self.engines)
            if engine is not None and engine.process.poll() is None
            and (i < self.args.replicas or i == joined or i in self._joined)
        ]  # fmt: skip
        if joined is not None:
            self._joined.add(joined)
        write_hosts_file(self.hosts_file, {HOST_NAME: live})

    def kill_engine(self, index: int) -> None:
        engine = self.engines[index]
        assert engine is not None
        engine.process.send_signal(signal.SIGKILL)
        engine.process.wait(timeout=10)

    def start_gateway(self, index: int) -> None:
        sock = tcp_socket()
        own = {**self.settings, "data_dir": str(self.tmp / f"gateway{index}")}
        stack = child_process(serve_gateway, own, sock, None, str(self.hosts_file))
        pid = stack.__enter__()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        wait_http(url + "/health", pid, timeout_s=120)
        sock.close()
        if index < len(self.gateway_urls):
            self.gateway_urls[index] = url
            self._gateway_stops[index] = (stack, pid)
        else:
            self.gateway_urls.append(url)
            self._gateway_stops.append((stack, pid))

    def kill_gateway(self, index: int) -> None:
        _, pid = self._gateway_stops[index]
        os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        for stack, _ in self._gateway_stops:
            stack.__exit__(None, None, None)
        stop_engines([e for e in self.engines if e is not None])
        self.redis.stop()


async def stream_turn(
    session: aiohttp.ClientSession, url: str, key: str, messages: list[dict[str, str]],
    attempt: Attempt, args: argparse.Namespace,
) -> str:  # fmt: skip
    """One streamed chat; fills ``attempt`` as it goes; the text received."""
    body = {
        "model": MODEL, "messages": messages, "max_tokens": args.max_tokens, "ignore_eos": True,
        "stream": True, "logprobs": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    parts: list[str] = []
    headers = {"authorization": f"Bearer {key}"}
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        attempt.status = r.status
        attempt.request_id = r.headers.get("x-request-id")
        if r.status != 200:
            answer = await r.json(content_type=None)
            attempt.error_code = (answer.get("error") or {}).get("code")
            return ""
        async for raw in r.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                attempt.is_done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    attempt.error_code = chunk["error"].get("code")
                for choice in chunk.get("choices") or ():
                    attempt.num_tokens += len((choice.get("logprobs") or {}).get("content") or ())
                    parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


async def run_load(
    load: Load, cluster: Cluster, workload: Any, keys: list[str],
    schedule: list[tuple[float, Callable[[], None]]],
) -> None:  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.monotonic()

        async def turn(messages: list[dict[str, str]], key: str) -> str:
            for _ in range(MAX_ATTEMPTS):
                gateway = load.next_gateway()
                attempt = Attempt(gateway)
                load.attempts.append(attempt)
                try:
                    text = await stream_turn(
                        session, cluster.gateway_urls[gateway], key, messages, attempt,
                        cluster.args,
                    )  # fmt: skip
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    attempt.was_cut = attempt.status is not None
                    load.gateway_alive[gateway] = False
                    text = ""
                if attempt.num_tokens:
                    return text
                await asyncio.sleep(RETRY_PAUSE_S)
            return ""

        async def strike(at_s: float, fault: Callable[[], None]) -> None:
            await asyncio.sleep(max(0.0, started + at_s - time.monotonic()))
            await asyncio.to_thread(fault)  # each on its own: a slow start delays no other

        await asyncio.gather(
            *(strike(at_s, fault) for at_s, fault in schedule),
            *(converse(c, workload, keys, started, turn) for c in workload.conversations),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, conversations=8)
    parser.add_argument(
        "--redis-without-aof",
        action="store_true",
        help="Redis keeps nothing across its restart (deploy/ runs it with an append-only file)",
    )
    args = parser.parse_args()
    from model_files.tokenizer import Tokenizer

    checkpoint = demo_model(args.size, args.model)
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    workload = make_workload(args, lambda text: len(tokenizer.encode(text)))
    span = workload.conversations[-1].start_s
    print(f"# {command_line()}")
    print(
        f"# {args.replicas} engines (+1 added) x {args.kv_blocks} KV blocks; "
        f"{len(workload.conversations)} conversations x {args.turns} turns over ~{span:.0f} s"
    )
    with tempfile.TemporaryDirectory(prefix="tw-faults-") as tmp_name, postgres_server() as pg:
        tmp = Path(tmp_name)
        database_url = pg.create_database("cluster_faults")
        from gateway.storage.migrate import upgrade

        upgrade(database_url)
        keys = make_tenant_keys(database_url, args.tenants)
        cluster = Cluster(args, tmp, checkpoint)
        try:
            start(cluster, database_url)
            load = Load()
            asyncio.run(run_load(load, cluster, workload, keys, faults(cluster, load, span)))
            ok = report(cluster, load, keys, database_url)
        finally:
            cluster.stop()
    raise SystemExit(0 if ok else 1)


def start(cluster: Cluster, database_url: str) -> None:
    cluster.redis.start()
    for index in range(cluster.args.replicas):
        cluster.start_engine(index)
    cluster.publish()
    # The engine that joins mid-run loads now (on 2 shared cores loading takes longer than
    # the load runs) and enters the DNS name only at its time, as a pod joins its headless
    # Service once ready.
    cluster.start_engine(cluster.args.replicas)
    cluster.settings = {
        "database_url": database_url,
        "redis_url": cluster.redis.url,
        "reservation_ttl_s": RESERVATION_TTL_S,
        "dns_refresh_s": 0.5,
        "health_check_interval_s": 1.0,
        "models": {
            MODEL: {
                "upstreams": [f"dns://{HOST_NAME}:{cluster.port}"],
                "context_window": context_window(cluster.checkpoint),
                "checkpoint": cluster.checkpoint,
                "replica_policy": "prefix",
            }
        },
    }
    for index in range(2):
        cluster.start_gateway(index)


def faults(cluster: Cluster, load: Load, span: float) -> list[tuple[float, Callable[[], None]]]:
    def logged(name: str, action: Callable[[], None]) -> Callable[[], None]:
        def strike() -> None:
            action()
            print(f"  {time.strftime('%H:%M:%S')} {name}", flush=True)

        return strike

    def kill_engine_0() -> None:
        # Mid-run: when it is generating (a stream is cut), or after 3 s of waiting for that.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not _num_running(_url(cluster, 0)):
            time.sleep(0.01)
        cluster.kill_engine(0)
        cluster.publish()  # the pod leaves the headless Service
        cluster.start_engine(0)  # restarted at once, as a kubelet does; slow to load here
        cluster.publish()  # ready: it rejoins

    def join_engine_4() -> None:
        cluster.publish(joined=cluster.args.replicas)  # started in `start`, ready: it joins

    def restart_redis() -> None:
        cluster.redis.kill()
        time.sleep(1.0)
        cluster.redis.start()

    def restart_gateway_1() -> None:
        cluster.start_gateway(1)
        load.gateway_alive[1] = True

    return [
        (0.20 * span, logged("SIGKILL engine 0; started again, it rejoined", kill_engine_0)),
        (0.50 * span, logged("SIGKILL gateway 1", lambda: cluster.kill_gateway(1))),
        (0.60 * span, logged("Redis SIGKILLed and started again", restart_redis)),
        (0.70 * span, logged("the added engine joined the DNS name", join_engine_4)),
        (0.85 * span, logged("gateway 1 started again", restart_gateway_1)),
    ]


# --- the checks ---------------------------------------------------------------------------


def report(cluster: Cluster, load: Load, keys: list[str], database_url: str) -> bool:
    from gateway.storage.database import Database
    from gateway.storage.usage_store import list_usage

    attempts = load.attempts
    statuses = Counter(a.status for a in attempts)
    print(f"attempts by status: {dict(sorted(statuses.items(), key=str))}")
    checks: list[tuple[str, bool]] = []
    refusals = [a for a in attempts if a.status not in (None, 200)]
    checks.append(("no 500 answer", all(a.status != 500 for a in attempts)))
    checks.append((
        "every refusal a 503 with an OpenAI error code",
        all(a.status == 503 and a.error_code for a in refusals),
    ))  # fmt: skip
    by_code = Counter(a.error_code for a in refusals)
    print(f"refusals by code: {dict(by_code)}")

    database = Database(database_url)
    try:
        records = _all_records(database, list_usage)
        engine_cut = [a for a in attempts if a.ended_by_error_event]
        gateway_cut = [a for a in attempts if a.was_cut]
        billed = [a for a in engine_cut if a.request_id in records]
        print(
            f"streams cut by an engine: {len(engine_cut)} (error event each); cut by their "
            f"gateway's death: {len(gateway_cut)}"
        )
        cut_check = "each stream cut by an engine billed exactly what its client received"
        if not engine_cut:  # the kill found no stream past its first token this time
            cut_check += " (none this run: tests/faults/test_engine_replicas.py covers it)"
        checks.append((
            cut_check,
            len(billed) == len(engine_cut)
            and all(records[a.request_id].completion_tokens == a.num_tokens for a in billed),  # type: ignore[index]
        ))  # fmt: skip
        answered = [a for a in attempts if a.status == 200 and not a.was_cut]
        deadline = time.monotonic() + 15  # the writers flush in batches
        while missing := [a for a in answered if a.request_id not in records]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
            records = _all_records(database, list_usage)
        print(f"answered: {len(answered)}, without a usage record: {len(missing)}")
        for attempt in missing:
            print(f"  no record: {attempt}")
        checks.append(("every answered request has its usage record", not missing))
        checks.append(("budget ledgers equal the records", _budgets_exact(cluster, keys, database)))
    finally:
        database.dispose()

    restarted = engine_counters(_url(cluster, 0))["requests"]
    added = engine_counters(_url(cluster, cluster.args.replicas))["requests"]
    print(f"requests to engine 0 after its restart: {restarted:.0f}; to the added one: {added:.0f}")
    checks.append(("the restarted engine rejoined", restarted > 0))
    checks.append(("the engine added by DNS received requests", added > 0))
    for name, ok in checks:
        print(f"{'OK    ' if ok else 'FAILED'} {name}")
    return all(ok for _, ok in checks)


def _all_records(database: Any, list_usage: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    with database.session() as session:
        cursor = None
        while True:
            page = list_usage(session, cursor=cursor, limit=1000)
            found.update((r.request_id, r) for r in page.records)
            if page.next_cursor is None:
                return found
            cursor = page.next_cursor


def _budgets_exact(cluster: Cluster, keys: list[str], database: Any) -> bool:
    """Once every reservation has lapsed or settled, each tenant's ledger ``used`` equals
    what its records charge."""
    from gateway.storage.usage_store import sum_tokens

    start = datetime(1970, 1, 1, tzinfo=timezone.utc)
    end = datetime(9999, 1, 1, tzinfo=timezone.utc)
    exact = True
    deadline = time.monotonic() + RESERVATION_TTL_S + 15
    for tenant, key in enumerate(keys):
        while True:
            budget = _budget(cluster.gateway_urls[0], key)
            with database.session() as session:
                totals = sum_tokens(session, f"tenant-{tenant}", start, end)
            charged = totals.prompt_tokens + totals.completion_tokens
            settled = budget["reserved"] == 0 and budget["used"] == charged
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if not settled:
            exact = False
            print(f"  tenant-{tenant}: ledger {budget}, records charge {charged}")
    return exact


def _budget(url: str, key: str) -> dict[str, int]:
    request = urllib.request.Request(url + "/v1/budget", headers={"authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return dict(json.loads(response.read()))


def _num_running(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("tollway_engine_requests_running "):
                return float(line.split()[1])
    return 0.0


def _url(cluster: Cluster, index: int) -> str:
    engine = cluster.engines[index]
    assert engine is not None
    return engine.url


if __name__ == "__main__":
    main()
