"""OpenTelemetry for kvharbor's HTTP services: one trace per request, spanning gateway and engine.

Shared by the gateway and the engine, so both speak the same propagation (W3C traceparent).

The gateway starts a span per request and sends its context in the `traceparent` header; the
engine continues it (engine/serve/api_server.py). Spans go to an OTLP/HTTP endpoint when one is
configured, else nowhere (the API still works, so spans cost little).
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter


def setup_tracing(service: str, otlp_endpoint: str | None = None, exporter: SpanExporter | None = None) -> trace.Tracer:
    """A tracer for `service`; the first call in a process installs the provider."""
    if otlp_endpoint and exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=otlp_endpoint)
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
    return trace.get_tracer(f"kvharbor.{service}")


def inject(headers: dict[str, str]) -> dict[str, str]:
    """`headers` plus the current trace context (traceparent)."""
    propagate.inject(headers)
    return headers


def extract(headers: Mapping[str, str]):
    """The trace context a caller sent, for a child span."""
    return propagate.extract(dict(headers))


def shutdown() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()
