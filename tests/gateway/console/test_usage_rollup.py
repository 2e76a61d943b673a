"""The rollup folds a window in the database: the chart's top series and the rest per bucket,
the table's top rows and the rest, each adding up to the window's records."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

from gateway.console.page_queries import ZERO, usage_series
from gateway.console.usage_rollup import OTHERS, add, usage_rollup
from gateway.storage.database import Database
from gateway.storage.models import UsageStatus
from gateway.storage.usage_store import UsageEntry, insert_usage

START = datetime(2026, 11, 20, tzinfo=timezone.utc)
HOUR = timedelta(hours=1)


def seed(db: Database, num_tenants: int) -> None:
    rng = random.Random(3)
    entries = []
    for n in range(600):
        tenant = f"t{n % num_tenants:02d}"
        prompt = rng.randint(1, 100)
        entries.append(
            UsageEntry(
                request_id=f"r{n}", tenant_id=tenant, key_id=None, requested_model="m",
                served_model=f"m{n % 3}", routing_decision=None, prompt_tokens=prompt,
                cached_tokens=rng.randint(0, prompt), completion_tokens=rng.randint(0, 50),
                cost_micros=(n % num_tenants) * 10 + rng.randint(0, 9),
                status=UsageStatus.COMPLETED, reject_reason=None, streamed=True,
                created_at=START + timedelta(seconds=rng.uniform(0, 6 * 3600)),
            )
        )  # fmt: skip
    with db.transaction() as session:
        insert_usage(session, entries)


def test_chart_and_table_fold_the_rest_and_add_up(db: Database) -> None:
    seed(db, num_tenants=30)
    with db.session() as session:
        rollup = usage_rollup(
            session, START, START + 6 * HOUR, HOUR, "tenant",
            num_chart_series=4, num_table_rows=10,
        )  # fmt: skip
        points = usage_series(session, START, START + 6 * HOUR, HOUR, "tenant")
    everything = ZERO
    for point in points:
        everything = add(everything, point.totals)
    assert rollup.num_series == 30
    assert [name for name, _ in rollup.table][:3] == ["t29", "t28", "t27"]  # by cost
    assert len(rollup.table) == 10
    assert rollup.total == everything
    charted = ZERO
    for point in rollup.points:
        charted = add(charted, point.totals)
    assert charted == everything
    assert {p.series for p in rollup.points} == {"t29", "t28", "t27", "t26", OTHERS}
    per_bucket = {p.bucket_start for p in rollup.points}
    assert per_bucket == {START + i * HOUR for i in range(6)}


def test_a_window_with_few_series_has_no_rest(db: Database) -> None:
    seed(db, num_tenants=3)
    with db.session() as session:
        rollup = usage_rollup(session, START, START + 6 * HOUR, HOUR, "model")
    assert rollup.rest == ZERO
    assert rollup.num_series == 3
    assert OTHERS not in {p.series for p in rollup.points}
