"""OpenTelemetry traces over OTLP/HTTP (vLLM's --otlp-traces-endpoint), for the API and the
workers: with an endpoint set, the API has a span per request (a child of the client's W3C
`traceparent` when it sends one) and hands its `traceparent` to the request's jobs; the worker
that finishes a job adds a `llm_request` span under it, with vLLM's `gen_ai.*` attributes
(the job's id, model, sampling, token counts, time in queue, to first token, end to end).

The OpenTelemetry SDK and exporter are imported only when an endpoint is set (`pip install
genq[otel]`); without one nothing here costs anything.
"""

from __future__ import annotations

import re
from typing import Any

TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")  # W3C trace context, version 00
EXPORT_DELAY_MS = 1000  # spans go out in batches at most this long after they end
EXPORT_TIMEOUT_S = 5  # one export's wait for the collector (a stopping process waits no longer)


class Tracing:
    """One process's tracer provider, exporting to `endpoint` as `service`."""

    def __init__(self, endpoint: str, service: str) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise RuntimeError(f"tracing to {endpoint} needs OpenTelemetry's SDK and OTLP exporter: "
                               "pip install 'genq[otel]'") from exc
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        exporter = OTLPSpanExporter(endpoint=_traces_url(endpoint), timeout=EXPORT_TIMEOUT_S)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS,
                                                            export_timeout_millis=EXPORT_TIMEOUT_S * 1000))
        self.tracer = self.provider.get_tracer("genq")
        self.propagator = TraceContextTextMapPropagator()

    def parent(self, traceparent: str | None) -> Any:
        """The OpenTelemetry context of a W3C traceparent (None: a new trace)."""
        return self.propagator.extract({"traceparent": traceparent}) if traceparent else None

    def traceparent(self, span: Any) -> str:
        """The W3C traceparent naming `span`, for the jobs it starts."""
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier["traceparent"]

    def shutdown(self) -> None:
        """Export what is left (a stopping process)."""
        self.provider.shutdown()


def _traces_url(endpoint: str) -> str:
    """OTLP/HTTP's traces path on a collector's base URL (as the exporter's env var takes it)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"
