"""The Usage page, its CSV and the tenant's own view agree with the usage records' sums over
the window: records inside it counted once, records outside it (before, at its end) not."""

from __future__ import annotations

import csv
import io
import random
import re
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from sqlalchemy import func, select

from gateway.console.page_queries import USAGE_WINDOWS
from gateway.storage import api_keys, tenants
from gateway.storage.models import UsageRecord, UsageStatus
from gateway.storage.usage_store import UsageEntry, insert_usage
from policies.scoped_budgets import format_money
from tests.gateway.console.console_client import ADMIN_KEY, START, Console, console

MODELS = ("small", "large", None)  # None: refused before a model was chosen


@pytest.fixture
def ui(sqlite_db_url: str) -> Iterator[Console]:
    with console(sqlite_db_url) as found:
        yield found


def record(n: int, tenant_id: str, at: datetime, rng: random.Random) -> UsageEntry:
    model = MODELS[n % len(MODELS)]
    prompt = rng.randint(0, 500)
    return UsageEntry(
        request_id=f"req-{n}",
        tenant_id=tenant_id,
        key_id=None,
        requested_model=model or "large",
        served_model=model,
        routing_decision=None,
        prompt_tokens=prompt if model else 0,
        cached_tokens=rng.randint(0, prompt) if model else 0,
        completion_tokens=rng.randint(0, 300) if model else 0,
        cost_micros=rng.randint(0, 10_000) if model else 0,
        status=UsageStatus.COMPLETED if model else UsageStatus.REJECTED,
        reject_reason=None if model else "budget",
        streamed=False,
        created_at=at,
        end_user=f"user-{n % 4}",
    )


def seed(ui: Console, num_records: int = 400) -> tuple[datetime, datetime]:
    """Records over three days around the 24h window's bounds; returns the window."""
    rng = random.Random(7)
    start, end = USAGE_WINDOWS["24h"].bounds(ui.clock())
    with ui.database.transaction() as session:
        for tenant_id in ("acme", "globex"):
            tenants.create_tenant(session, tenant_id, name="", tier="standard", quota={})
        edges = [start, end, start - timedelta(microseconds=1), end - timedelta(microseconds=1)]
        entries = []
        for n in range(num_records):
            at = (
                edges[n]
                if n < len(edges)
                else start + timedelta(seconds=rng.uniform(-86400, 2 * 86400))
            )
            entries.append(record(n, ("acme", "globex")[n % 2], at, rng))
        insert_usage(session, entries)
    return start, end


def record_sums(
    ui: Console, start: datetime, end: datetime, tenant_id: str | None = None
) -> tuple[int, ...]:
    query = select(
        func.count(),
        func.sum(UsageRecord.prompt_tokens),
        func.sum(UsageRecord.cached_tokens),
        func.sum(UsageRecord.completion_tokens),
        func.sum(UsageRecord.cost_micros),
    ).where(UsageRecord.created_at >= start, UsageRecord.created_at < end)
    if tenant_id is not None:
        query = query.where(UsageRecord.tenant_id == tenant_id)
    with ui.database.session() as session:
        row = session.execute(query).one()
    return tuple(int(value or 0) for value in row)


def csv_sums(text: str) -> tuple[int, ...]:
    rows = list(csv.DictReader(io.StringIO(text)))
    names = (
        "num_requests",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "cost_micros_USD",
    )
    for row in rows:
        assert int(row["total_tokens"]) == int(row["prompt_tokens"]) + int(row["completion_tokens"])
    return tuple(sum(int(row[name]) for row in rows) for name in names)


def test_the_csv_sums_equal_the_records_sums_by_model_and_by_tenant(ui: Console) -> None:
    start, end = seed(ui)
    expected = record_sums(ui, start, end)
    assert 0 < expected[0] < 400  # the window holds some records, not all
    ui.sign_in(ADMIN_KEY)
    for by in ("model", "tenant"):
        exported = ui.client.get(f"/ui/usage.csv?window=24h&by={by}")
        assert exported.status_code == 200
        assert exported.headers["content-type"].startswith("text/csv")
        assert csv_sums(exported.text) == expected
    one = ui.client.get("/ui/usage.csv?window=24h&tenant=acme")
    assert csv_sums(one.text) == record_sums(ui, start, end, "acme")


def test_the_page_shows_the_records_totals(ui: Console) -> None:
    start, end = seed(ui)
    num_requests, prompt, cached, completion, cost = record_sums(ui, start, end)
    ui.sign_in(ADMIN_KEY)
    page = ui.client.get("/ui/usage?window=24h")
    assert page.status_code == 200
    totals = re.sub(r"\s+", " ", page.text.split('id="usage-totals">', 1)[1].split("</p>", 1)[0])
    assert f"<strong>{num_requests:,}</strong> requests" in totals
    assert f"<strong>{prompt + completion:,}</strong> tokens" in totals
    assert f"<strong>{format_money(cost)} USD</strong>" in totals  # the prices' currency
    assert f"<strong>{cached / prompt:.0%}</strong>" in totals
    assert page.text.count("<svg") >= 2  # the tokens and cost charts
    assert "<script" not in page.text


def test_the_tenant_view_shows_only_its_own_usage(ui: Console) -> None:
    start, end = seed(ui)
    with ui.database.transaction() as session:
        key = api_keys.create_key(session, "acme", name="k").key
    ui.sign_in(key)
    exported = ui.client.get("/ui/my/usage.csv?window=24h")
    assert exported.status_code == 200
    assert csv_sums(exported.text) == record_sums(ui, start, end, "acme")
    page = ui.client.get("/ui/my?window=24h")
    assert page.status_code == 200
    assert "globex" not in page.text


def test_an_unknown_window_is_a_400(ui: Console) -> None:
    ui.sign_in(ADMIN_KEY)
    refused = ui.client.get("/ui/usage?window=1y")
    assert refused.status_code == 400
    assert "Unknown window" in refused.text
    assert ui.client.get("/ui/usage?tenant=nobody").status_code == 404
    assert ui.clock() == START  # the window was the fixed clock's
