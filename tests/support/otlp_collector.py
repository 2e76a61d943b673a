"""A stand-in OpenTelemetry collector: a plain HTTP server on 127.0.0.1 that accepts OTLP/HTTP
trace exports (``POST /v1/traces``, protobuf) and keeps the spans it decoded, so a test can
check what an exporter really sent over the wire.

    with OtlpCollector() as collector:
        ...  # point the exporter at collector.traces_url
        span = collector.wait_for_span(lambda span: span.name == "chat gateway")
        attributes = span_attributes(span)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

TRACES_PATH = "/v1/traces"


class OtlpCollector:
    """Spans received, in arrival order, with the resource attributes of their batch."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.resources: list[dict[str, Any]] = []
        self.content_types: list[str] = []
        self._changed = threading.Condition()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.path != TRACES_PATH:
                    self.send_response(404)
                    self.end_headers()
                    return
                collector._receive(body, self.headers.get("content-type", ""))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def traces_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}{TRACES_PATH}"

    def __enter__(self) -> OtlpCollector:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _receive(self, body: bytes, content_type: str) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        with self._changed:
            self.content_types.append(content_type)
            for resource_spans in request.resource_spans:
                resource = attribute_dict(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(span)
                        self.resources.append(resource)
            self._changed.notify_all()

    def wait_for_span(self, predicate: Callable[[Span], bool], timeout_s: float = 10.0) -> Span:
        """The first span received that satisfies ``predicate``, waiting up to ``timeout_s``."""
        found: list[Span] = []

        def received() -> bool:
            found[:] = [span for span in self.spans if predicate(span)][:1]
            return bool(found)

        with self._changed:
            if not self._changed.wait_for(received, timeout=timeout_s):
                names = [span.name for span in self.spans]
                raise AssertionError(f"no matching span within {timeout_s} s; received {names}")
        return found[0]


def attribute_dict(attributes: Any) -> dict[str, Any]:
    """OTLP ``KeyValue``s as a plain dict of Python values."""
    return {item.key: _value(item.value) for item in attributes}


def span_attributes(span: Span) -> dict[str, Any]:
    return attribute_dict(span.attributes)


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind is not None else None
