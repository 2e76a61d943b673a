"""Spans reach an OTLP/HTTP collector with the GenAI semantic-convention attributes, and no
prompt text: a real gateway, the torch-free stand-in engine, and a stand-in collector that
decodes what the exporter sent."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from gateway.observability.tracing import build_tracer_provider
from tests.support.otlp_collector import OtlpCollector, span_attributes
from tests.support.stand_in_engine import MODEL
from tests.support.stand_in_stack import (
    gateway,
    stand_in_engine,
    stand_in_settings,
    tenant_key,
)

NUM_CHUNKS = 5
EXPORT_DELAY_MS = "50"  # the batch span processor's (5 s by default)
PROMPT = "a secret prompt that must not reach a span"


@pytest.fixture(autouse=True)
def _export_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", EXPORT_DELAY_MS)


@contextmanager
def traced_gateway(db_url: str, tmp_path: Path) -> Iterator[tuple[OtlpCollector, str]]:
    """A gateway exporting its spans to a stand-in collector, before the stand-in engine:
    ``(collector, base_url)``."""
    with (
        OtlpCollector() as collector,
        stand_in_engine(num_chunks=NUM_CHUNKS) as engine,
        gateway(
            stand_in_settings(engine, tmp_path / "gw", db_url, otel_endpoint=collector.traces_url)
        ) as base,
    ):
        yield collector, base


def _has_usage(span: Span) -> bool:
    return "gen_ai.usage.output_tokens" in span_attributes(span)


def test_a_completion_is_exported_over_otlp_http_with_gen_ai_attributes(
    sqlite_db_url: str, tmp_path: Path
) -> None:
    _, key = tenant_key(sqlite_db_url)
    with traced_gateway(sqlite_db_url, tmp_path) as (collector, base):
        response = httpx.post(
            f"{base}/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 7,
            },
            timeout=30,
        )
        assert response.status_code == 200, response.text
        request_id = response.headers["x-request-id"]
        span = collector.wait_for_span(_has_usage)
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == NUM_CHUNKS
    attributes = span_attributes(span)
    assert span.name == "chat gateway"
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.system"] == "tollway"
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.response.model"] == MODEL
    assert attributes["gen_ai.request.max_tokens"] == 7
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] > 0
    assert attributes["gen_ai.usage.output_tokens"] == NUM_CHUNKS
    assert attributes["tollway.request_id"] == request_id
    assert attributes["tollway.usage.status"] == "completed"
    assert span.end_time_unix_nano > span.start_time_unix_nano > 0
    assert all(PROMPT not in str(value) for value in attributes.values())
    assert collector.resources[0]["service.name"] == "tollway-gateway"
    assert collector.content_types[0] == "application/x-protobuf"


def test_a_streamed_completion_is_exported_with_the_tokens_it_streamed(
    sqlite_db_url: str, tmp_path: Path
) -> None:
    _, key = tenant_key(sqlite_db_url)
    with traced_gateway(sqlite_db_url, tmp_path) as (collector, base):
        with httpx.stream(
            "POST",
            f"{base}/v1/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": MODEL, "prompt": "one two three", "max_tokens": 9, "stream": True},
            timeout=30,
        ) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        span = collector.wait_for_span(_has_usage)
    assert events[-1] == "data: [DONE]"
    attributes = span_attributes(span)
    assert span.name == "text_completion gateway"
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.max_tokens"] == 9
    assert attributes["gen_ai.usage.output_tokens"] == NUM_CHUNKS


def test_no_endpoint_and_no_exporter_means_no_tracing() -> None:
    assert build_tracer_provider(None) is None
