"""The worker's Prometheus metrics: vLLM's metric names under the `genq:` prefix.

Counters and histograms live in a registry of their own (several workers can share a test
process); `serve` exposes it over HTTP when a metrics port is configured. The totals are
also what the heartbeat reports.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from producer.protocol import split_ref

if TYPE_CHECKING:
    from producer.tracing import Tracing
    from worker.queue.engine_thread import EngineStats
    from worker.queue.jobs import HeldJob

# Buckets as in vLLM (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)
QUEUE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, *E2E_BUCKETS)  # a job mostly waits far less than it runs


class WorkerMetrics:
    def __init__(self, model_name: str, tracing: Tracing | None = None) -> None:
        self.model_name = model_name
        self.tracing = tracing  # a span per finished job (producer.tracing), when traces are exported
        self.registry = CollectorRegistry()

        def child(kind: Any, name: str, doc: str, **kwargs: Any) -> Any:
            # Bound to the label once: labels() per call was a visible cost per token.
            metric = kind(name, doc, ["model_name"], registry=self.registry, **kwargs)
            return metric.labels(model_name)

        self._running = child(Gauge, "genq:num_requests_running", "Requests in the running queue")
        self._waiting = child(Gauge, "genq:num_requests_waiting", "Requests in the waiting queue")
        self._kv = child(Gauge, "genq:kv_cache_usage_perc", "KV-cache usage, 1 = full")
        self._gen = child(Counter, "genq:generation_tokens", "Generated tokens")
        self._prompt = child(Counter, "genq:prompt_tokens", "Prefilled prompt tokens")
        self._done = child(Counter, "genq:request_success", "Jobs finished by this worker")
        self._ttft = child(Histogram, "genq:time_to_first_token_seconds", "Submit to first token",
                           buckets=TTFT_BUCKETS)
        self._itl = child(Histogram, "genq:inter_token_latency_seconds", "Time between tokens",
                          buckets=ITL_BUCKETS)
        self._e2e = child(Histogram, "genq:e2e_request_latency_seconds", "Submit to last token",
                          buckets=E2E_BUCKETS)
        # time in the stream, by priority lane (how long a tier's jobs wait for a worker)
        self._queue_time = Histogram(
            "genq:request_queue_time_seconds", "Submit to being taken off the requests stream",
            ["model_name", "lane"], registry=self.registry, buckets=QUEUE_BUCKETS,
        )
        self._handoffs_sent = child(Counter, "genq:affinity_handoffs_sent", "Jobs handed to the worker whose prefix "
                                    "cache holds their prompt's start (worker.queue.affinity)")
        self._handoffs_taken = child(Counter, "genq:affinity_handoffs_taken", "Jobs other workers handed here")
        # counters of the engine's totals (EngineStats fields), which go up by what is new since the last stats
        self._totals = {
            "spec_decode_num_draft_tokens": child(Counter, "genq:spec_decode_num_draft_tokens",
                                                  "Speculative tokens computed"),
            "spec_decode_num_accepted_tokens": child(Counter, "genq:spec_decode_num_accepted_tokens",
                                                     "Speculative tokens kept"),
            "prefix_cache_queries": child(Counter, "genq:prefix_cache_queries", "Prompt tokens looked up in the "
                                          "prefix cache"),
            "prefix_cache_hits": child(Counter, "genq:prefix_cache_hits", "Prompt tokens the prefix cache held"),
            "prefix_cache_host_hits": child(Counter, "genq:prefix_cache_host_hits", "Prompt tokens the prefix "
                                            "cache held in host memory (KV offloading), copied back"),
        }
        self._totals_seen = dict.fromkeys(self._totals, 0)
        self.generation_tokens_total = 0
        self.prompt_tokens_total = 0
        self.requests_finished_total = 0
        self.handoffs_taken_total = 0
        self._rate_mark = (time.monotonic(), 0)  # (when, generation tokens then)

    def serve(self, port: int, host: str) -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def engine_stats(self, stats: EngineStats) -> None:
        self._running.set(stats.num_running)
        self._waiting.set(stats.num_waiting)
        self._kv.set(stats.kv_cache_usage)
        for name, counter in self._totals.items():
            total = getattr(stats, name)
            counter.inc(total - self._totals_seen[name])
            self._totals_seen[name] = total

    def handed_off(self, count: int) -> None:
        self._handoffs_sent.inc(count)

    def handed_in(self, count: int) -> None:
        self.handoffs_taken_total += count
        self._handoffs_taken.inc(count)

    def taken(self, held: HeldJob) -> None:
        """`held` goes to the engine: its wait in the stream, unless it is a reclaimed job's
        rerun (its wait was counted by its first worker)."""
        if not held.resumed:
            lane = split_ref(held.entry_id)[1] or "normal"
            self._queue_time.labels(self.model_name, lane).observe(max(0.0, held.received_at - held.job.submit_time))

    def prompt_tokens(self, num_tokens: int) -> None:
        self.prompt_tokens_total += num_tokens
        self._prompt.inc(num_tokens)

    def tokens(self, held: HeldJob, num_tokens: int, now: float) -> None:
        """`num_tokens` new tokens of `held` in the step that ended at unix time `now`."""
        if num_tokens == 0:
            return
        self.generation_tokens_total += num_tokens
        self._gen.inc(num_tokens)
        if held.last_token_at is None:
            held.first_token_at = now
            if not held.resumed:
                self._ttft.observe(max(0.0, now - held.job.submit_time))
        else:
            gap = (now - held.last_token_at) / num_tokens
            for _ in range(num_tokens):
                self._itl.observe(gap)
        held.last_token_at = now

    def finished(self, held: HeldJob, now: float) -> None:
        self.requests_finished_total += 1
        self._done.inc()
        self._e2e.observe(max(0.0, now - held.job.submit_time))
        if self.tracing is not None:
            self._trace(held, now)

    def _trace(self, held: HeldJob, now: float) -> None:
        """The job's `llm_request` span, from its submit to the step of its last token (now,
        for a job that sent none), under the request that made it, with vLLM's attribute names."""
        job, params, tracing = held.job, held.job.sampling_params, self.tracing
        assert tracing is not None
        end = held.last_token_at or now  # (before its last write: whoever waits on it sees it end after)
        span = tracing.tracer.start_span("llm_request", context=tracing.parent(job.traceparent),
                                         start_time=int(job.submit_time * 1e9))
        attributes: dict[str, Any] = {
            "gen_ai.request.id": job.id, "gen_ai.response.model": job.model or self.model_name,
            "gen_ai.request.n": params.n, "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p, "gen_ai.usage.completion_tokens": held.num_output_tokens,
            "gen_ai.latency.time_in_queue": max(0.0, held.received_at - job.submit_time),
            "gen_ai.latency.e2e": max(0.0, end - job.submit_time),
        }
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if held.prompt_tokens is not None:
            attributes["gen_ai.usage.prompt_tokens"] = held.prompt_tokens
        if held.first_token_at is not None and not held.resumed:
            attributes["gen_ai.latency.time_to_first_token"] = max(0.0, held.first_token_at - job.submit_time)
        span.set_attributes(attributes)
        span.end(end_time=int(end * 1e9))

    def tokens_per_s(self) -> float:
        """Generated tokens per second since the previous call (the heartbeat's rate)."""
        then, count = self._rate_mark
        now = time.monotonic()
        self._rate_mark = (now, self.generation_tokens_total)
        return (self.generation_tokens_total - count) / max(now - then, 1e-9)
