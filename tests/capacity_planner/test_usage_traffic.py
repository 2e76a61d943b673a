"""Traffic and request shape from usage records: the summary (pure), and ``tollway plan
--from-usage`` against a PostgreSQL database the gateway filled with real requests."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from capacity_planner.usage_traffic import (
    UsageSample,
    busiest_window,
    percentile,
    summarize_usage,
)
from gateway.launcher.cli import app
from gateway.storage.database import Database
from gateway.storage.migrate import upgrade
from gateway.storage.usage_store import list_usage
from tests.support.polling import wait_until
from tests.support.postgres_server import PostgresServer
from tests.support.stand_in_engine import MODEL
from tests.support.stand_in_stack import gateway, stand_in_engine, stand_in_settings, tenant_key

T0 = datetime(2026, 3, 1, tzinfo=timezone.utc)
MODEL_OPTIONS = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--params", "8e9"]


def sample(second: float, prompt: int, output: int, cached: int = 0) -> UsageSample:
    return UsageSample(T0 + timedelta(seconds=second), prompt, output, cached)


def test_percentiles_are_nearest_rank() -> None:
    values = list(range(1, 11))  # 1..10
    assert (percentile(values, 50), percentile(values, 90), percentile(values, 100)) == (5, 9, 10)
    assert percentile([7], 90) == 7


def test_the_busiest_window_slides() -> None:
    # 30 to 80 s are within a minute; a fixed grid of minutes would see 3 and 2 of them.
    assert busiest_window([30, 50, 55, 65, 80, 200], 60) == 5
    assert busiest_window([0, 60, 120], 60) == 1  # the window is half-open
    assert busiest_window([], 60) == 0


def test_the_summary_of_a_day() -> None:
    samples = [sample(i * 3600, 1000, 200, cached=500) for i in range(24)]  # one an hour
    samples += [sample(43_200 + i, 3000, 600) for i in range(30)]  # a burst at noon
    usage = summarize_usage(samples, start=T0, end=T0 + timedelta(days=1))
    assert usage is not None
    assert usage.num_requests == 54
    assert usage.requests_per_day == 54
    assert usage.peak_requests_per_s == 31 / 60  # the burst and noon's hourly request
    assert (usage.prompt_tokens_p50, usage.prompt_tokens_p90) == (3000, 3000)
    assert usage.output_tokens_mean == pytest.approx((24 * 200 + 30 * 600) / 54)
    assert usage.cached_fraction == pytest.approx(24 * 500 / (24 * 1000 + 30 * 3000))
    traffic = usage.traffic()
    # requests a day × peak factor / 86,400 s is the peak rate again.
    assert traffic.requests_per_day / 86_400 * traffic.peak_factor == pytest.approx(31 / 60)
    assert summarize_usage([], start=T0, end=T0 + timedelta(days=1)) is None


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    name = f"plan_{uuid.uuid4().hex[:12]}"
    url = postgres_server.create_database(name)
    upgrade(url)
    return url


def stored(url: str, tenant_id: str) -> int:
    database = Database(url)
    try:
        with database.session() as session:
            return len(list_usage(session, tenant_id=tenant_id, limit=1000).records)
    finally:
        database.dispose()


def test_plan_from_usage_records_the_gateway_wrote_to_postgresql(
    postgres_url: str, tmp_path: Path
) -> None:
    tenant_id, key = tenant_key(postgres_url)
    other_id, other_key = tenant_key(postgres_url)
    words = [10 * (i + 1) for i in range(20)]  # 10, 20, ..., 200 words: the stand-in's tokens
    with (
        stand_in_engine(num_chunks=4) as engine,
        gateway(stand_in_settings(engine, tmp_path / "gw", postgres_url)) as base_url,
        httpx.Client(base_url=base_url, timeout=30) as client,
    ):
        for bearer, sizes in ((key, words), (other_key, [1000] * 3)):
            for size in sizes:
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": " ".join(["word"] * size)}],
                    "stream": size % 20 == 0,
                }
                response = client.post(
                    "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {bearer}"}
                )
                assert response.status_code == 200, response.text
        wait_until(lambda: stored(postgres_url, tenant_id) == 20, what="20 usage records")
        wait_until(lambda: stored(postgres_url, other_id) == 3, what="3 usage records")

    result = CliRunner().invoke(
        app,
        [
            "plan",
            "--from-usage",
            postgres_url,
            "--tenant",
            tenant_id,
            "--usage-days",
            "1",
            *MODEL_OPTIONS,
            "--gpu",
            "h100-80gb",
            "--format",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    usage = plan["usage"]
    assert usage["num_requests"] == 20  # the other tenant's 3 are not in it
    assert (usage["prompt_tokens_p50"], usage["prompt_tokens_p90"]) == (100, 180)
    assert usage["prompt_tokens_mean"] == pytest.approx(sum(words) / 20)
    assert (usage["output_tokens_mean"], usage["output_tokens_p90"]) == (4, 4)
    assert usage["cached_fraction"] == 0
    assert usage["peak_requests_per_s"] == pytest.approx(20 / 60)  # all within a minute
    assert plan["peak_requests_per_s"] == pytest.approx(20 / 60)
    # The p90 lengths size the KV cache: 180 + 4 tokens of context.
    assert plan["context_tokens"] == 184

    everyone = CliRunner().invoke(
        app,
        ["plan", "--from-usage", postgres_url, "--usage-days", "1", "--gpu", "l4",
         *MODEL_OPTIONS, "--format", "json"],
    )  # fmt: skip
    assert everyone.exit_code == 0, everyone.output
    assert json.loads(everyone.stdout)["usage"]["num_requests"] == 23


def test_plan_from_usage_without_records_says_so(postgres_url: str) -> None:
    result = CliRunner().invoke(
        app,
        ["plan", "--from-usage", postgres_url, "--tenant", "nobody", "--gpu", "l4", *MODEL_OPTIONS],
    )
    assert result.exit_code == 1
    assert result.output.strip() == (
        "error: no completed request of tenant 'nobody' in the last 7 days to plan from"
    )
