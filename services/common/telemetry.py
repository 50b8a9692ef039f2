"""OpenTelemetry tracing for one process, and W3C trace-context propagation over gRPC and HTTP.

Exporters: OTLP/gRPC when ``[telemetry] otlp_endpoint`` (or the standard ``OTEL_EXPORTER_OTLP_ENDPOINT``)
is set; otherwise JSON lines, one file per process, under ``[telemetry] trace_dir`` (``kvconductor up``
points it at the run directory); otherwise none. Sampling is parent-based with
``trace_sample_ratio`` for new traces, so one request is traced in every process or in none.

Every gRPC server span is opened by ``services.common.rpc``'s interceptor from the caller's ``traceparent``
metadata; every client call made through ``services.common.rpc.channel`` sends the current context. So a
request is one trace: gateway -> Conductor -> kvmeta / prefill (KV copy, compute, KV transfer) -> decode.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased

from services.common.config import TelemetryConfig

tracer = trace.get_tracer("kvconductor")


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span as one JSON line (the OpenTelemetry SDK's ``to_json`` form)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Write the spans."""
        lines = [json.dumps(json.loads(span.to_json()), separators=(",", ":")) for span in spans]
        with self._lock:
            self._file.write("".join(line + "\n" for line in lines))
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Close the file."""
        with self._lock:
            self._file.close()


def setup_tracing(config: TelemetryConfig, service: str, instance_id: str) -> TracerProvider:
    """Install this process's tracer provider (call once, before serving)."""
    resource = Resource.create({"service.name": f"kvconductor-{service}", "service.instance.id": instance_id})
    endpoint = config.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    # Without an exporter no span goes anywhere: record none (the trace context still propagates).
    sampler = ParentBased(TraceIdRatioBased(config.trace_sample_ratio)) if endpoint or config.trace_dir else ALWAYS_OFF
    provider = TracerProvider(resource=resource, sampler=sampler)
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    elif config.trace_dir:
        exporter = JsonLinesSpanExporter(Path(config.trace_dir) / f"{instance_id}.jsonl")
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    return provider


def inject_metadata() -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata (``traceparent``, ``tracestate``)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def extract_context(carrier: Mapping[str, str] | Sequence[tuple[str, str | bytes]]) -> Context:
    """The trace context a caller sent (gRPC metadata pairs or HTTP headers)."""
    if isinstance(carrier, Mapping):
        return propagate.extract(carrier)
    return propagate.extract({k: v for k, v in carrier if isinstance(v, str)})
