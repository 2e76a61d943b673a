"""OpenTelemetry spans for the gateway, exported only when configured.

Each app owns its tracer provider (never the global one). Without an endpoint and without an
explicit exporter the tracer is a no-op. Span attributes follow the GenAI semantic conventions
(``gen_ai.request.model``, ``gen_ai.response.model``, ``gen_ai.usage.input_tokens``,
``gen_ai.usage.output_tokens``); prompts and completions are never attached.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter


def build_tracer_provider(
    otel_endpoint: str | None, exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """A provider exporting to ``exporter`` or to OTLP/HTTP at ``otel_endpoint``; else None."""
    if exporter is None and otel_endpoint is None:
        return None
    if exporter is None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
        except ImportError:
            raise ValueError(
                "otel_endpoint is set but opentelemetry-exporter-otlp-proto-http is not "
                "installed: pip install opentelemetry-exporter-otlp-proto-http, or unset it"
            ) from None
        exporter = OTLPSpanExporter(endpoint=otel_endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": "tollway-gateway"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def tracer_from(provider: TracerProvider | None) -> trace.Tracer:
    if provider is None:
        return trace.NoOpTracer()
    return provider.get_tracer("tollway.gateway")
