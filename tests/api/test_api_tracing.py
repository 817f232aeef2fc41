"""OpenTelemetry traces (producer.tracing) from a live stack to a collector of the test's own,
which reads OTLP/HTTP's protobuf with OpenTelemetry's own message classes: a request the
client traces gets the API's span under the client's, and its job the worker's `llm_request`
span under the API's, with the token counts the response reported."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from api.settings import Settings

TRACE_ID, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


class Collector:
    """An OTLP/HTTP traces endpoint: every span it is sent, as (service, span) pairs."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                request = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["content-length"])))
                for resource_spans in request.resource_spans:
                    service = next(a.value.string_value for a in resource_spans.resource.attributes
                                   if a.key == "service.name")
                    collector.spans += [(service, span) for scope in resource_spans.scope_spans for span in scope.spans]
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of_trace(self, trace_id: str) -> list[tuple[str, Any]]:
        return [(service, span) for service, span in list(self.spans) if span.trace_id.hex() == trace_id]


def attributes(span: Any) -> dict[str, Any]:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    collector = Collector()
    yield collector
    collector.server.shutdown()


@pytest.fixture(scope="module")
def traced_worker(stack_redis, run_worker, tiny_llama_dir: Path, tmp_path_factory, collector: Collector) -> Iterator[str]:
    with run_worker(stack_redis.url, tiny_llama_dir, tmp_path_factory.mktemp("traced-worker"),
                    ("--otlp-traces-endpoint", collector.url)) as url:
        yield url


def test_a_traced_request_and_its_job_are_spans_of_the_clients_trace(
    traced_worker: str, serve_api, collector: Collector, served_model: str, poll: Callable[..., Any]
) -> None:
    settings = Settings(redis_url=traced_worker, otlp_traces_endpoint=collector.url, request_timeout_s=60.0)
    with serve_api(settings) as url:
        assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200  # a scrape: no span
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=served_model, messages=[{"role": "user", "content": "Trace me."}], max_tokens=5, temperature=0.0,
            extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}, extra_body={"ignore_eos": True})
        spans = poll(lambda: len(collector.of_trace(TRACE_ID)) >= 2 and collector.of_trace(TRACE_ID), 30.0,
                     "the request's and its job's spans")
    assert not any(span.name.endswith("/metrics") for _, span in collector.spans)  # (exported before ours, if any)
    by_service = {service: span for service, span in spans}
    api, job = by_service["genq-api"], by_service["genq-worker"]
    assert api.name == "POST /v1/chat/completions" and api.parent_span_id.hex() == CLIENT_SPAN
    assert attributes(api)["http.response.status_code"] == 200
    assert job.name == "llm_request" and job.parent_span_id == api.span_id
    seen = attributes(job)
    assert seen["gen_ai.usage.prompt_tokens"] == reply.usage.prompt_tokens
    assert seen["gen_ai.usage.completion_tokens"] == reply.usage.completion_tokens == 5
    assert (seen["gen_ai.request.max_tokens"], seen["gen_ai.request.temperature"]) == (5, 0.0)
    assert 0 <= seen["gen_ai.latency.time_in_queue"] <= seen["gen_ai.latency.time_to_first_token"] \
        <= seen["gen_ai.latency.e2e"]
    assert api.start_time_unix_nano <= job.start_time_unix_nano and job.end_time_unix_nano <= api.end_time_unix_nano
