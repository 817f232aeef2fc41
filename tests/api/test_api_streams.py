"""Streaming behaviour of a live stack: a client that disconnects cancels its job, many
concurrent streams share one pub/sub connection and get their own tokens, and the latency
histograms and cluster gauges reach /metrics; /health is 200 with a live worker."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import openai
import redis
from prometheus_client.parser import text_string_to_metric_families

from producer.protocol import Keys

LONG = {"max_tokens": 900, "ignore_eos": True, "stream": True}


def first_chunk(lines: Iterator[str]) -> dict:
    """The first chunk, read from `lines` without closing it (closing the iterator would
    close the connection: a disconnect)."""
    while not (line := next(lines)).startswith("data: "):
        pass
    return json.loads(line[6:])


def job_status(http: httpx.Client, job_id: str) -> str:
    return http.get(f"/v1/jobs/{job_id}").json()["status"]


def test_client_disconnect_cancels_the_job(http: httpx.Client, poll) -> None:
    body = {**LONG, "messages": [{"role": "user", "content": "Talk."}]}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        chunk = first_chunk(response.iter_lines())  # leaving the block closes the connection
    job_id = chunk["id"].removeprefix("chatcmpl-")
    poll(lambda: job_status(http, job_id) == "cancelled", what="job cancelled")
    view = http.get(f"/v1/jobs/{job_id}").json()
    assert len(view["outputs"][0]["token_ids"]) < 900


def test_non_streaming_disconnect_cancels_the_job(
    api_url: str, live_worker: str, served_model: str, poll
) -> None:
    """A client that sent a non-streaming request and hangs up while its job generates: the
    job is cancelled, not run to its end for nobody."""
    admin = redis.Redis.from_url(live_worker)
    keys = Keys()
    before = set(admin.scan_iter(match=keys.job("*")))
    body = json.dumps(
        {"model": served_model, "prompt": "Long", "max_tokens": 1000, "ignore_eos": True}
    ).encode()
    host, port = api_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: genq\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        (key,) = poll(lambda: set(admin.scan_iter(match=keys.job("*"))) - before, what="job")
        job_id = key.decode().removeprefix(keys.job(""))
        poll(lambda: admin.xlen(keys.events(job_id)) >= 5, what="tokens generated")
    # the connection is closed: the API cancels the job, which ends well short of 1000 tokens
    poll(lambda: admin.hget(key, "status") in (b"cancelled", b"finished"), what="job ended")
    assert admin.hget(key, "status") == b"cancelled"
    assert int(admin.hget(key, "completion_tokens")) < 1000
    admin.close()


def test_concurrent_streams_share_one_pubsub_connection(
    http: httpx.Client, live_worker: str, poll
) -> None:
    admin = redis.Redis.from_url(live_worker)
    baseline = {c["id"]: int(c["sub"]) for c in admin.client_list()}
    num_streams = 6
    with ExitStack() as streams:
        job_ids, readers = [], []
        for i in range(num_streams):
            body = {**LONG, "prompt": f"Stream {i}"}
            response = streams.enter_context(http.stream("POST", "/v1/completions", json=body))
            readers.append(response.iter_lines())
            job_ids.append(first_chunk(readers[-1])["id"].removeprefix("cmpl-"))
        clients = admin.client_list()
        grown = {c["id"]: int(c["sub"]) - baseline.get(c["id"], 0) for c in clients}
        assert sorted(v for v in grown.values() if v) == [num_streams]  # all on one connection
        channels = [f"genq:events:{j}" for j in job_ids]
        assert [n for _, n in admin.pubsub_numsub(*channels)] == [1] * num_streams
    # the clients went away: their jobs are cancelled and the relay leaves their channels
    poll(lambda: all(n == 0 for _, n in admin.pubsub_numsub(*channels)), what="unsubscribed")
    poll(lambda: all(job_status(http, j) == "cancelled" for j in job_ids), what="cancelled")
    admin.close()


def test_concurrent_streams_each_get_their_own_tokens(served_model: str, api_url: str) -> None:
    client = openai.OpenAI(base_url=f"{api_url}/v1", api_key="x", max_retries=0, timeout=60)
    prompts = ["Once upon", "The sky", "Hello", "Numbers"] * 2

    def run(prompt: str, stream: bool) -> str:
        kwargs = {"model": served_model, "prompt": prompt, "max_tokens": 10, "temperature": 0.0,
                  "extra_body": {"ignore_eos": True}}
        if not stream:
            return client.completions.create(**kwargs).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))

    with ThreadPoolExecutor(len(prompts)) as pool:
        streamed = list(pool.map(lambda p: run(p, True), prompts))
    assert streamed == [run(p, False) for p in prompts]
    client.close()


def test_metrics_and_health(served_model: str, http: httpx.Client, poll) -> None:
    http.post("/v1/completions", json={"model": served_model, "prompt": "Hi", "max_tokens": 4,
                                       "ignore_eos": True})

    def metrics() -> dict[str, float]:
        text = http.get("/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    # the worker's counters arrive with its next heartbeat
    samples = poll(lambda: (m := metrics())["genq:generation_tokens_total"] >= 4 and m)
    assert samples["genq:num_workers"] == 1
    for name in ("genq:time_to_first_token_seconds", "genq:inter_token_latency_seconds",
                 "genq:e2e_request_latency_seconds"):
        assert samples[f"{name}_count"] >= 1, name
    for name in ("genq:num_requests_running", "genq:num_requests_waiting", "genq:queue_depth"):
        assert samples[name] >= 0
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["models"] == [served_model]
