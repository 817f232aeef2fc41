"""Prometheus metrics, vLLM's names under a `genq:` prefix, in a registry per app.

Two sources: latency histograms the API observes for the requests it relays, and the cluster's
state (queue depth, worker heartbeats) read from Redis when /metrics is scraped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.cluster import LiveWorker, QueueDepth
from producer.protocol import Event

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ClusterCollector(Collector):
    """Gauges and counters from the last snapshot `update` stored (taken just before a
    scrape). Counters are sums over live workers: one that dies takes its counts with it."""

    def __init__(self) -> None:
        self._depths: dict[str, QueueDepth] = {}
        self._workers: list[LiveWorker] = []
        self._batches = 0
        self._webhooks = 0

    def update(self, depths: dict[str, QueueDepth], workers: list[LiveWorker], batches: int = 0,
               webhooks: int = 0) -> None:
        """`depths`: by queue ("": the shared stream), as Cluster.queue_depths reads them;
        `webhooks`: the events in the webhook outbox."""
        self._depths, self._workers, self._batches, self._webhooks = depths, workers, batches, webhooks

    def collect(self) -> Iterator[Metric]:
        workers = [w.info for w in self._workers]
        depth = QueueDepth(sum(d.undelivered for d in self._depths.values()),
                           sum(d.pending for d in self._depths.values()))
        running = sum(w.running for w in workers)
        yield _gauge("genq:num_workers", "Live workers (heartbeat present).", len(workers))
        yield _gauge("genq:num_workers_sleeping", "Live workers asleep (sleep mode): they take no jobs.",
                     sum(1 for w in workers if w.sleep_level))
        yield _gauge("genq:num_workers_paused", "Live workers paused (POST /pause): they take no jobs.",
                     sum(1 for w in workers if w.paused))
        yield _gauge("genq:num_requests_running", "Jobs in the workers' running batches.", running)
        yield _gauge(
            "genq:num_requests_waiting",
            "Jobs accepted but not running: in the stream or in a worker's waiting queue.",
            depth.undelivered + sum(w.waiting for w in workers),
        )
        yield _gauge(
            "genq:queue_depth",
            "Stream entries not yet delivered plus delivered but not acknowledged.",
            depth.total,
        )
        by_queue = GaugeMetricFamily("genq:queue_depth_by_queue", "genq:queue_depth of each queue's stream "
                                     '(queue="" is the shared genq:requests).', labels=["queue"])
        by_lane = GaugeMetricFamily("genq:queue_depth_by_lane", "genq:queue_depth of each priority lane's stream "
                                    '(lane="high": priority < 0, "normal": 0, "low": > 0).', labels=["queue", "lane"])
        for queue, queue_depth in sorted(self._depths.items()):
            by_queue.add_metric([queue], queue_depth.total)
            for lane, lane_depth in queue_depth.lanes.items():
                by_lane.add_metric([queue, lane or "normal"], lane_depth.total)
        yield by_queue
        yield by_lane
        yield _gauge(
            "genq:generation_tokens_per_second", "Sum of the workers' recent generation rates.",
            sum(w.tokens_per_s for w in workers),
        )
        yield _gauge(
            "genq:kv_cache_usage_perc", "Mean fraction of KV-cache blocks in use (1 = full).",
            sum(w.kv_cache_usage for w in workers) / len(workers) if workers else 0.0,
        )
        yield _gauge("genq:batches_active", "Batches (/v1/batches) not yet ended.", self._batches)
        yield _gauge("genq:webhook_events_unsent", "Webhook events in the outbox: not yet delivered, or resting "
                     "between failed attempts (api.webhooks).", self._webhooks)
        yield _counter("genq:generation_tokens", "Generated tokens (live workers).",
                       sum(w.generation_tokens_total for w in workers))
        yield _counter("genq:prompt_tokens", "Prefilled prompt tokens (live workers).",
                       sum(w.prompt_tokens_total for w in workers))
        yield _counter("genq:request_success", "Finished jobs (live workers).",
                       sum(w.requests_finished_total for w in workers))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)  # exposed as `<name>_total`


class Metrics:
    """Everything /metrics exposes, in one registry owned by one app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "genq:time_to_first_token_seconds", "Request arrival to its first token, at the API.",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.itl = Histogram(
            "genq:inter_token_latency_seconds", "Between a job's successive token events.",
            buckets=ITL_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "genq:e2e_request_latency_seconds", "Request arrival to the end of its last job.",
            buckets=E2E_BUCKETS, registry=self.registry,
        )
        self.cluster = ClusterCollector()
        self.registry.register(self.cluster)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Latencies of one relayed request, observed as its events arrive."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._start = time.monotonic()
        self._first_token: float | None = None
        self._last_token: dict[str, float] = {}  # per job

    def on_event(self, job_id: str, event: Event) -> None:
        if not event.token_ids:
            return
        now = time.monotonic()
        if self._first_token is None:
            self._first_token = now
            self._metrics.ttft.observe(now - self._start)
        last = self._last_token.get(job_id)
        if last is not None:
            self._metrics.itl.observe(now - last)
        self._last_token[job_id] = now

    def on_end(self) -> None:
        self._metrics.e2e.observe(time.monotonic() - self._start)
