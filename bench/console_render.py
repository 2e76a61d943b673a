"""How long each console page takes to render with a large tenant base: 1,000 tenants and
1,000,000 usage records in PostgreSQL. Target: every page under 300 ms.

    python -m bench.console_render                                # its own PostgreSQL
    python -m bench.console_render --num-records 200000 --repeats 5
    python -m bench.console_render --database-url postgresql+psycopg://...   # an empty one

The records are spread uniformly over the last ``--days`` (90) days, tenants drawn with a
long tail (a few busy, most quiet), five models, 50 end users a tenant, two keys a tenant
(one with a money budget) and an end-user budget for each tenant, bulk-loaded with COPY into
the migrated schema, then VACUUM ANALYZEd (as autovacuum leaves an append-only table).
Each page is requested through the console app itself (`build_console` over the database,
Starlette's TestClient: routing, session check, queries, template and SVG, no network),
once to warm up, then ``--repeats`` times; the median, the slowest and the page's size are
reported.
"""

from __future__ import annotations

import argparse
import io
import random
import re
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import func, select
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from bench.workloads import command_line
from gateway.auth.epochs import MemoryAuthEpochs
from gateway.console.console_app import MOUNT_PATH, build_console
from gateway.console.console_context import FleetSources
from gateway.observability.metrics import GatewayMetrics
from gateway.rollouts import LiveRollouts, parse_rollouts
from gateway.settings import GatewaySettings
from gateway.storage.api_keys import generate_key, hash_key
from gateway.storage.database import Database
from gateway.storage.migrate import upgrade
from gateway.storage.models import UsageRecord
from gateway.upstream.prefix_index import PrefixIndex
from gateway.upstream.replica_set import ReplicaSet
from tests.support.postgres_server import postgres_server

ADMIN_KEY = "admin-" + "r" * 40
MODELS = ("small", "large-v1", "large-v2", "code", "embed")
TARGET_MS = 300.0
CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
USAGE_COLUMNS = (
    "request_id", "tenant_id", "key_id", "requested_model", "served_model", "model_version",
    "routing_decision", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_micros",
    "status", "reject_reason", "streamed", "created_at", "finished_at", "ttft_ms",
    "finish_reason", "end_user",
)  # fmt: skip


@contextmanager
def database_url(given: str | None) -> Iterator[str]:
    if given is not None:
        yield given
        return
    with postgres_server() as server:
        yield server.create_database("console_bench")


def load(url: str, num_tenants: int, num_records: int, days: int, now: datetime) -> str:
    """Tenants, keys, budgets and usage records, bulk-loaded; returns a tenant key's secret."""
    import psycopg

    rng = random.Random(30)
    conninfo = url.replace("postgresql+psycopg://", "postgresql://")
    tenant_ids = [f"tenant-{i:04d}" for i in range(num_tenants)]
    key_ids = {t: [f"key_{t}_{k}" for k in range(2)] for t in tenant_ids}
    viewer_key = generate_key()
    with psycopg.connect(conninfo) as connection, connection.cursor() as cursor:
        stamp = now.isoformat()
        quota = '{"budget_micros": 50000000, "budget_period": "month", "tier": "standard"}'
        with cursor.copy(
            "COPY tenants (id, name, tier, quota, created_at, updated_at) FROM STDIN"
        ) as copy:
            for t in tenant_ids:
                copy.write_row((t, f"Tenant {t}", "standard", quota, stamp, stamp))
        columns = "id, tenant_id, prefix, key_hash, name, priority, created_at"
        with cursor.copy(f"COPY api_keys ({columns}) FROM STDIN") as copy:
            for t in tenant_ids:
                for n, key_id in enumerate(key_ids[t]):
                    secret = viewer_key if (t, n) == (tenant_ids[0], 0) else generate_key()
                    copy.write_row((key_id, t, secret[:12], hash_key(secret), f"k{n}", None, stamp))
        columns = "tenant_id, scope, subject, unit, amount, period, created_at, updated_at"
        with cursor.copy(f"COPY scoped_budgets ({columns}) FROM STDIN") as copy:
            for t in tenant_ids:
                copy.write_row(
                    (t, "key", key_ids[t][0], "micros", 5_000_000, "month", stamp, stamp)
                )
                copy.write_row((t, "user", "user-1", "tokens", 200_000, "day", stamp, stamp))
        weights = [1 / (i + 1) for i in range(num_tenants)]  # a long tail of quiet tenants
        rng.shuffle(weights)
        span_s = days * 86400
        with cursor.copy(f"COPY usage_records ({', '.join(USAGE_COLUMNS)}) FROM STDIN") as copy:
            chunk = 50_000
            for first in range(0, num_records, chunk):
                n = min(chunk, num_records - first)
                tenants = rng.choices(tenant_ids, weights, k=n)
                buffer = io.StringIO()
                for i, t in enumerate(tenants, start=first):
                    model = MODELS[i % len(MODELS)]
                    prompt = rng.randint(20, 2000)
                    cached = rng.randint(0, prompt) if i % 3 else 0
                    completion = rng.randint(1, 800)
                    at = now - timedelta(seconds=rng.random() * span_s)
                    cost = prompt * 2 - cached + completion * 6
                    buffer.write(
                        f"req-{i}\t{t}\t{key_ids[t][i % 2]}\t{model}\t{model}\t{model}\t\\N\t"
                        f"{prompt}\t{cached}\t{completion}\t{cost}\tcompleted\t\\N\tf\t"
                        f"{at.isoformat()}\t\\N\t\\N\tstop\tuser-{i % 50}\n"
                    )
                copy.write(buffer.getvalue())
        connection.commit()
    with psycopg.connect(conninfo, autocommit=True) as connection:
        # What autovacuum does to an append-only table in production (PostgreSQL 13+ vacuums
        # after inserts): statistics, and the visibility map index-only scans need.
        connection.execute("VACUUM ANALYZE")
    return viewer_key


def settings_for(url: str) -> GatewaySettings:
    return GatewaySettings.from_dict(
        {
            "database_url": url,
            "admin_key_hash": hash_key(ADMIN_KEY),
            "models": {
                m: {
                    "upstreams": [f"http://10.0.0.{i}:8000", f"http://10.0.1.{i}:8000"],
                    "context_window": 8192,
                }
                for i, m in enumerate(MODELS)
            },
            "rollouts": {"large": {"large-v1": 90, "large-v2": 10}},
        }
    )


def signed_in(client: TestClient, key: str) -> None:
    token = CSRF.search(client.get("/ui/sign-in").text)
    assert token is not None
    answer = client.post(
        "/ui/sign-in", data={"api_key": key, "csrf_token": token.group(1)}, follow_redirects=False
    )
    if answer.status_code != 303:
        raise RuntimeError(f"sign-in failed: {answer.status_code}")


def time_page(client: TestClient, path: str, repeats: int) -> tuple[float, float, int]:
    """(median ms, slowest ms, bytes) of ``repeats`` GETs after one to warm up."""
    first = client.get(path)
    if first.status_code != 200:
        raise RuntimeError(f"{path}: {first.status_code} {first.text[:300]}")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        answer = client.get(path)
        times.append((time.perf_counter() - start) * 1000)
        if answer.status_code != 200:
            raise RuntimeError(f"{path}: {answer.status_code}")
    return statistics.median(times), max(times), len(first.content)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-tenants", type=int, default=1000)
    parser.add_argument("--num-records", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=90)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--database-url", default=None, help="an empty PostgreSQL database")
    args = parser.parse_args()
    now = datetime.now(timezone.utc)
    with database_url(args.database_url) as url:
        upgrade(url)
        started = time.perf_counter()
        viewer_key = load(url, args.num_tenants, args.num_records, args.days, now)
        print(f"loaded {args.num_tenants} tenants and {args.num_records:,} usage records over "
              f"{args.days} days in {time.perf_counter() - started:.1f} s")  # fmt: skip
        database = Database(url)
        settings = settings_for(url)
        metrics = GatewayMetrics()
        for m in MODELS:
            for seconds in (0.04, 0.08, 0.3):
                metrics.child(metrics.time_to_first_token, m, m).observe(seconds)
        fleet = FleetSources(
            ReplicaSet({m: settings.models[m].upstreams for m in MODELS}),
            PrefixIndex(),
            metrics.registry,
            LiveRollouts(parse_rollouts({"large": {"large-v1": 90, "large-v2": 10}})),
        )
        console = build_console(settings, database, MemoryAuthEpochs(), fleet=fleet)
        app = Starlette(routes=[Mount(MOUNT_PATH, app=console)])
        busiest = busiest_tenant(database)
        admin_pages = [
            "/ui/tenants",
            "/ui/tenants?cursor=tenant-0499",
            f"/ui/tenants/{busiest}",
            "/ui/usage?window=1h",
            "/ui/usage?window=24h",
            "/ui/usage?window=24h&by=tenant",
            "/ui/usage?window=7d",
            "/ui/usage?window=30d",
            "/ui/usage?window=30d&by=tenant",
            f"/ui/usage?window=30d&tenant={busiest}",
            "/ui/usage.csv?window=24h&by=tenant",
            "/ui/fleet",
            "/ui/audit",
        ]
        tenant_pages = ["/ui/my?window=24h", "/ui/my?window=30d"]
        print(f"{'page':44} {'median ms':>10} {'max ms':>8} {'KiB':>6}  target {TARGET_MS:.0f} ms")
        worst = 0.0
        for key, pages in ((ADMIN_KEY, admin_pages), (viewer_key, tenant_pages)):
            with TestClient(app) as client:
                signed_in(client, key)
                for path in pages:
                    median, slowest, size = time_page(client, path, args.repeats)
                    worst = max(worst, median)
                    mark = "" if median < TARGET_MS else "  OVER"
                    print(f"{path:44} {median:10.1f} {slowest:8.1f} {size / 1024:6.0f}{mark}")
        database.dispose()
    print(f"slowest median {worst:.1f} ms ({'within' if worst < TARGET_MS else 'over'} target)")
    print(f"command: {command_line()}")


def busiest_tenant(database: Database) -> str:
    with database.session() as session:
        query = (
            select(UsageRecord.tenant_id)
            .group_by(UsageRecord.tenant_id)
            .order_by(func.count().desc())
            .limit(1)
        )
        return str(session.scalar(query))


if __name__ == "__main__":
    main()
