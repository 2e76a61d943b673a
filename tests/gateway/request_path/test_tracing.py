"""OpenTelemetry spans carry the GenAI semantic-convention attributes, and no prompt text."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.observability.tracing import build_tracer_provider

from .conftest import SMALL, Engines, settings_for, tenant_key


def test_a_completion_is_traced_with_gen_ai_attributes(
    engines: Engines, gateway: Callable[..., str], db_url: str, tmp_path: Path
) -> None:
    exporter = InMemorySpanExporter()
    _, key = tenant_key(db_url)
    base = gateway(settings_for(engines, tmp_path / "gw", db_url), span_exporter=exporter)
    prompt = "a secret prompt that must not reach a span"
    response = httpx.post(
        f"{base}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": SMALL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 3},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    deadline = time.monotonic() + 10
    spans = []
    while time.monotonic() < deadline:
        spans = [s for s in exporter.get_finished_spans() if s.attributes]
        if any("gen_ai.usage.output_tokens" in (s.attributes or {}) for s in spans):
            break
        time.sleep(0.05)
    span = next(s for s in spans if "gen_ai.usage.output_tokens" in (s.attributes or {}))
    attributes = dict(span.attributes or {})
    assert attributes["gen_ai.request.model"] == SMALL
    assert attributes["gen_ai.response.model"] == SMALL
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attributes["gen_ai.request.max_tokens"] == 3
    assert all(prompt not in str(value) for value in attributes.values())


def test_no_exporter_means_no_tracing() -> None:
    assert build_tracer_provider(None) is None


def test_an_otel_endpoint_exports_over_otlp_http() -> None:
    provider = build_tracer_provider("http://127.0.0.1:9/v1/traces")
    assert provider is not None
    provider.shutdown()
