"""A Tollway cluster on one machine under a multi-tenant load whose prefixes repeat, once per
replica policy, in one run.

Processes: ``--replicas`` engines (``python -m backend_engine`` on a demo checkpoint, one
thread each, ``--kv-blocks`` KV blocks each), two gateway replicas sharing one Redis and one
PostgreSQL (the wheels the tests use), and this load generator. Every policy runs on fresh
engines (empty caches) and fresh gateways; the same seeded schedule runs under each.

The load: ``--tenants`` tenants, each with its own system prompt of about
``--system-tokens`` tokens and ``--conversations`` conversations of ``--turns`` turns. A
turn sends the conversation so far (system prompt, earlier questions and the engine's own
answers) plus a new question, so each turn extends its own history. Conversations start as
a Poisson process (``--rate`` a second); a conversation's next turn follows its answer after
an exponential think time (mean ``--think-s``). Every request streams, ``--max-tokens``
with ``ignore_eos``, alternately to each gateway.

Reported per policy: the prefix-cache hit rate in tokens (the engines' own counters: cached
prompt tokens over prompt tokens admitted), time to first token (mean, p90), requests per
replica and the busiest over the mean, and completion tokens a second. The reference for the
hit rate is one engine holding the pooled cache (``--replicas`` x the blocks) under the same
load. The targets (issue #16): with 4 replicas, ``prefix`` reaches >= 90% of the pooled hit
rate, its mean TTFT is >= 3x lower than ``round_robin``'s, and no replica serves more than
1.5x the mean.

    python -m bench.cluster             # 4 replicas: pooled, round_robin, least_loaded, prefix
    python -m bench.cluster --policies round_robin prefix --rate 1.5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway_stack import serve_gateway, tcp_socket
from bench.workloads import command_line, demo_model
from tests.support.child_process import child_process, wait_http
from tests.support.polling import wait_until
from tests.support.postgres_server import postgres_server
from tests.support.redis_server import redis_server

POLICIES = ("round_robin", "least_loaded", "prefix")
MODEL = "chat"
REPO_ROOT = Path(__file__).resolve().parents[1]
QUOTA = {"budget_tokens": 10**15, "budget_period": "month", "rpm": 10**9, "tpm": 10**15}
WORDS = (
    "account", "balance", "cluster", "engine", "gateway", "tenant", "prompt", "answer", "budget",
    "request", "replica", "cache", "block", "token", "stream", "policy", "model", "version",
    "rollout", "metric", "queue", "memory", "prefix", "window", "drain", "health", "probe",
    "secret", "config", "storage", "ledger", "record", "invoice", "customer", "support", "ticket",
)  # fmt: skip


# --- the workload ------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    tenant: int
    start_s: float  # after the run starts
    questions: tuple[str, ...]
    think_s: tuple[float, ...]  # before each turn after the first


@dataclass(frozen=True)
class Workload:
    system_prompts: tuple[str, ...]  # one per tenant
    conversations: tuple[Conversation, ...]


def make_workload(args: argparse.Namespace, count_tokens: Any) -> Workload:
    rng = random.Random(args.seed)
    prompts = []
    for tenant in range(args.tenants):
        words = [f"You are the assistant of tenant {tenant}."]
        while count_tokens(" ".join(words)) < args.system_tokens:
            words.append(rng.choice(WORDS))
        prompts.append(" ".join(words))
    conversations = []
    clock = 0.0
    for _ in range(args.tenants * args.conversations):
        clock += rng.expovariate(args.rate)
        questions = tuple(
            " ".join(rng.choice(WORDS) for _ in range(args.question_words)) + "?"
            for _ in range(args.turns)
        )
        thinks = tuple(rng.expovariate(1 / args.think_s) for _ in range(args.turns - 1))
        conversations.append(Conversation(rng.randrange(args.tenants), clock, questions, thinks))
    return Workload(tuple(prompts), tuple(conversations))


# --- the processes -----------------------------------------------------------------------


@dataclass(frozen=True)
class Engine:
    url: str
    process: subprocess.Popen[bytes]


@contextmanager
def engines(checkpoint: str, count: int, kv_blocks: int, log_dir: Path) -> Iterator[list[Engine]]:
    """``count`` engine processes on free ports, each with ``kv_blocks`` KV blocks."""
    started: list[Engine] = []
    try:
        for i in range(count):
            sock = tcp_socket()
            port = sock.getsockname()[1]
            sock.close()
            log = log_dir / f"engine{i}.log"
            started.append(start_engine(checkpoint, "127.0.0.1", port, kv_blocks, log))
        for i, engine in enumerate(started):
            wait_ready(engine, log_dir / f"engine{i}.log")
        yield started
    finally:
        stop_engines(started)


def start_engine(checkpoint: str, host: str, port: int, kv_blocks: int, log: Path) -> Engine:
    """An engine process on ``host:port`` (one thread, ``kv_blocks`` KV blocks), not yet
    ready (`wait_ready`)."""
    command = [
        sys.executable, "-m", "backend_engine", "--model", checkpoint,
        "--host", host, "--port", str(port), "--served-model-name", MODEL,
        "--num-kv-blocks", str(kv_blocks), "--num-threads", "1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    with log.open("ab") as output:
        process = subprocess.Popen(command, stdout=output, stderr=output, env=env)
    return Engine(f"http://{host}:{port}", process)


def stop_engines(engines: list[Engine]) -> None:
    for engine in engines:
        if engine.process.poll() is None:
            engine.process.terminate()
    for engine in engines:
        try:
            engine.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            engine.process.kill()


def wait_ready(engine: Engine, log: Path, timeout_s: float = 300.0) -> None:
    """Until the engine's ``/ready`` says 200 (its model is loaded); its log's tail if it
    exits first."""

    def is_ready() -> bool:
        if engine.process.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:]
            raise RuntimeError(f"engine {engine.url} exited: {' '.join(tail)}")
        try:
            with urllib.request.urlopen(engine.url + "/ready", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    wait_until(is_ready, timeout_s, f"engine {engine.url} ready")


@contextmanager
def gateways(settings: dict[str, Any], count: int = 2) -> Iterator[list[str]]:
    """``count`` gateway processes with the same settings (shared Redis and database)."""
    with ExitStack() as stack:
        urls = []
        for i in range(count):
            sock = tcp_socket()
            own = {**settings, "data_dir": f"{settings['data_dir']}-{i}"}  # its spill file
            pid = stack.enter_context(child_process(serve_gateway, own, sock, None))
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            wait_http(url + "/health", pid)
            urls.append(url)
        yield urls


def make_tenant_keys(database_url: str, num_tenants: int) -> list[str]:
    from gateway.storage.api_keys import create_key
    from gateway.storage.database import Database
    from gateway.storage.tenants import create_tenant

    database = Database(database_url)
    try:
        keys = []
        with database.transaction() as session:
            for tenant in range(num_tenants):
                tenant_id = f"tenant-{tenant}"
                create_tenant(session, tenant_id, name=tenant_id, tier="standard", quota=QUOTA)
                keys.append(create_key(session, tenant_id).key)
        return keys
    finally:
        database.dispose()


def context_window(checkpoint: str) -> int:
    from model_files.checkpoint import Checkpoint

    return int(Checkpoint(checkpoint).model_config().max_position_embeddings)


# --- the load ----------------------------------------------------------------------------


@dataclass
class Outcome:
    ttft_s: list[float] = field(default_factory=list)
    num_completion_tokens: int = 0
    num_failed: int = 0
    failures: list[str] = field(default_factory=list)


async def run_load(
    workload: Workload, gateway_urls: list[str], keys: list[str], args: argparse.Namespace
) -> tuple[Outcome, float]:
    outcome = Outcome()
    turn = iter(range(10**9))
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.monotonic()

        async def ask(messages: list[dict[str, str]], key: str) -> str | None:
            url = gateway_urls[next(turn) % len(gateway_urls)]
            answer = await stream_chat(session, url, key, messages, args)
            if answer is None:
                outcome.num_failed += 1
                return None
            text, ttft, num_tokens = answer
            outcome.ttft_s.append(ttft)
            outcome.num_completion_tokens += num_tokens
            return text

        await asyncio.gather(
            *(converse(c, workload, keys, started, ask) for c in workload.conversations)
        )
        return outcome, time.monotonic() - started


async def converse(
    conversation: Conversation,
    workload: Workload,
    keys: list[str],
    started: float,
    ask: Callable[[list[dict[str, str]], str], Awaitable[str | None]],
) -> None:
    """One conversation on its schedule: each turn sends the history so far plus a new
    question (``ask(messages, key)``: the answer's text, or None to end the conversation)."""
    await asyncio.sleep(max(0.0, started + conversation.start_s - time.monotonic()))
    messages = [{"role": "system", "content": workload.system_prompts[conversation.tenant]}]
    for index, question in enumerate(conversation.questions):
        if index:
            await asyncio.sleep(conversation.think_s[index - 1])
        messages.append({"role": "user", "content": question})
        text = await ask(messages, keys[conversation.tenant])
        if text is None:
            return
        messages.append({"role": "assistant", "content": text})


async def stream_chat(
    session: aiohttp.ClientSession,
    gateway_url: str,
    key: str,
    messages: list[dict[str, str]],
    args: argparse.Namespace,
) -> tuple[str, float, int] | None:
    """``(text, ttft_s, completion_tokens)`` of one streamed chat, or None if it failed."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    ttft: float | None = None
    parts: list[str] = []
    num_tokens = 0
    headers = {"authorization": f"Bearer {key}"}
    async with session.post(f"{gateway_url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            print(f"  request failed: {r.status} {(await r.text())[:200]}", file=sys.stderr)
            return None
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return None
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.monotonic() - start
                    parts.append(content)
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    if ttft is None:
        return None
    return "".join(parts), ttft, num_tokens


# --- the engines' counters ---------------------------------------------------------------


def engine_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    wanted = {
        "tollway_engine_prefix_cache_queries_total": "queries",
        "tollway_engine_prefix_cache_hits_total": "hits",
        "tollway_engine_prompt_tokens_total": "prompt_tokens",
    }
    counters = dict.fromkeys(wanted.values(), 0.0)
    counters["requests"] = 0.0
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            counters[wanted[name]] = float(value)
        elif name.startswith("tollway_engine_http_requests_total{") and "chat" in name:
            counters["requests"] += float(value)
    return counters


# --- one run -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    name: str
    hit_rate: float
    ttft_mean_ms: float
    ttft_p90_ms: float
    per_replica: tuple[int, ...]
    tokens_per_s: float
    num_failed: int

    @property
    def max_over_mean(self) -> float:
        mean = statistics.fmean(self.per_replica)
        return max(self.per_replica) / mean if mean else 0.0


def run_policy(
    name: str,
    policy: str,
    num_replicas: int,
    kv_blocks: int,
    workload: Workload,
    args: argparse.Namespace,
    services: tuple[str, Any],
    checkpoint: str,
    tmp: Path,
) -> Result:
    redis_url, postgres = services
    database_url = postgres.create_database(f"cluster_{name}")
    from gateway.storage.migrate import upgrade

    upgrade(database_url)
    keys = make_tenant_keys(database_url, args.tenants)
    with engines(checkpoint, num_replicas, kv_blocks, tmp) as running:
        settings = {
            "data_dir": str(tmp / f"gw-{name}"),
            "database_url": database_url,
            "redis_url": redis_url,
            "models": {
                MODEL: {
                    "upstreams": [engine.url for engine in running],
                    "context_window": context_window(checkpoint),
                    "checkpoint": checkpoint,
                    "replica_policy": policy,
                }
            },
        }
        with gateways(settings) as urls:
            before = [engine_counters(e.url) for e in running]
            outcome, wall_s = asyncio.run(run_load(workload, urls, keys, args))
            after = [engine_counters(e.url) for e in running]
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    queries = sum(d["queries"] for d in delta)
    ttfts = sorted(outcome.ttft_s) or [0.0]
    return Result(
        name=name,
        hit_rate=sum(d["hits"] for d in delta) / queries if queries else 0.0,
        ttft_mean_ms=1000 * statistics.fmean(ttfts),
        ttft_p90_ms=1000 * ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        per_replica=tuple(int(d["requests"]) for d in delta),
        tokens_per_s=outcome.num_completion_tokens / wall_s,
        num_failed=outcome.num_failed,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--no-pooled", action="store_true", help="skip the pooled reference")
    args = parser.parse_args()

    from model_files.tokenizer import Tokenizer

    checkpoint = demo_model(args.size, args.model)
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    workload = make_workload(args, lambda text: len(tokenizer.encode(text)))
    num_requests = len(workload.conversations) * args.turns
    print(f"# {command_line()}")
    print(
        f"# {args.replicas} replicas x {args.kv_blocks} KV blocks; {args.tenants} tenants x "
        f"{args.conversations} conversations x {args.turns} turns = {num_requests} requests; "
        f"system prompts ~{args.system_tokens} tokens; checkpoint {checkpoint}"
    )
    runs = [] if args.no_pooled else [("pooled", "round_robin", 1, args.kv_blocks * args.replicas)]
    runs += [(policy, policy, args.replicas, args.kv_blocks) for policy in args.policies]
    results = []
    with tempfile.TemporaryDirectory(prefix="tw-cluster-") as tmp, ExitStack() as stack:
        redis_url = stack.enter_context(redis_server(tmp)).url
        postgres = stack.enter_context(postgres_server())
        for name, policy, num_replicas, kv_blocks in runs:
            print(f"# running {name} ...", flush=True)
            result = run_policy(
                name, policy, num_replicas, kv_blocks, workload, args,
                (redis_url, postgres), checkpoint, Path(tmp),
            )  # fmt: skip
            results.append(result)
            print_result(result)
    print_summary(results)


def add_workload_args(parser: argparse.ArgumentParser, *, conversations: int = 4) -> None:
    """The cluster's size and its load (shared with `bench.cluster_faults`)."""
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--kv-blocks", type=int, default=256, help="per replica (16 tokens each)")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--conversations", type=int, default=conversations, help="per tenant")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--question-words", type=int, default=12)
    parser.add_argument("--rate", type=float, default=2.0, help="conversations started a second")
    parser.add_argument("--think-s", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--size", default="small", help="demo checkpoint size")
    parser.add_argument("--model", default=None, help="a checkpoint instead of the demo one")
    parser.add_argument("--seed", type=int, default=0)


def print_result(r: Result) -> None:
    print(
        f"{r.name:>12}  hit rate {100 * r.hit_rate:5.1f}%  TTFT mean {r.ttft_mean_ms:7.1f} ms  "
        f"p90 {r.ttft_p90_ms:7.1f} ms  {r.tokens_per_s:6.1f} tok/s  per replica "
        f"{list(r.per_replica)} (max/mean {r.max_over_mean:.2f})  failed {r.num_failed}",
        flush=True,
    )


def print_summary(results: list[Result]) -> None:
    by_name = {r.name: r for r in results}
    prefix, pooled, rr = by_name.get("prefix"), by_name.get("pooled"), by_name.get("round_robin")
    if prefix is None:
        return
    if pooled is not None and pooled.hit_rate:
        ratio = prefix.hit_rate / pooled.hit_rate
        print(f"prefix hit rate / pooled: {ratio:.2f} (target >= 0.90)")
    if rr is not None and prefix.ttft_mean_ms:
        ratio = rr.ttft_mean_ms / prefix.ttft_mean_ms
        print(f"round_robin mean TTFT / prefix: {ratio:.2f}x (target >= 3x)")
    print(f"prefix busiest replica / mean: {prefix.max_over_mean:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()
