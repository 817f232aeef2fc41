"""The API on a Redis Cluster: what it writes together (a file and the files' index, a batch,
its lines and the active set, a line's result, a conversation and its items, a message batch
and its index, a webhook's outbox entry, the workers' pause command) works where a cluster has no transaction across slots
(`producer.redis_conn.ordered_writes`, single-key scripts), with a worker on the cluster
serving the jobs. Three masters without replicas, on Redis 7 where the set-up unpacked it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from batch_support import chat_line, read_file, run_batch, wait_done
from openai.types.chat import ChatCompletion
from webhook_support import SECRET, Receiver

from api.settings import Settings
from producer.protocol import Keys
from producer.records import decode_worker_info
from producer.redis_cluster import RedisClusterNodes
from producer.redis_conn import connect
from producer.redis_server import find_redis7_server

WORKER = "cluster-api"


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    nodes = RedisClusterNodes(tmp_path_factory.mktemp("api-cluster"), replicas=0, binary=find_redis7_server()).start()
    yield nodes
    nodes.stop()


@pytest.fixture(scope="module")
def live_worker(redis_cluster: RedisClusterNodes, tiny_llama_dir: Path, run_worker,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_worker(redis_cluster.url, tiny_llama_dir, tmp_path_factory.mktemp("worker"), name=WORKER) as url:
        yield url


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()  # (it fails the first event's first try: the outbox sends it again)
    yield receiver
    receiver.server.shutdown()


@pytest.fixture(scope="module")
def api_url(live_worker: str, serve_api, receiver: Receiver) -> Iterator[str]:
    settings = Settings(redis_url=live_worker, request_timeout_s=60.0, server_dev_mode=True,
                        webhook_url=receiver.url, webhook_secret=SECRET, batch_poll_s=0.1)
    with serve_api(settings) as url:
        yield url


def test_a_batch_on_a_cluster_answers_as_the_endpoint_does_and_its_files_come_and_go(
    served_model: str, oai: openai.OpenAI, poll: Callable[..., Any], receiver: Receiver, live_worker: str,
) -> None:
    """... and its end is announced by webhook, sent again after the receiver's first failure,
    then acknowledged and deleted from the outbox."""
    lines = [chat_line("plain", served_model), chat_line("two", served_model, n=2, temperature=1.0, seed=5)]
    batch = run_batch(oai, lines)
    assert batch.id in [b.id for b in oai.batches.list()]
    done = wait_done(oai, batch.id, poll)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 2, 0)
    outputs = read_file(oai, done.output_file_id)
    for line in lines:  # the same request sent directly: the same tokens (greedy or seeded)
        direct = oai.post("/chat/completions", body=line["body"], cast_to=ChatCompletion)
        body = outputs[line["custom_id"]]["response"]["body"]
        assert [c["message"]["content"] for c in body["choices"]] == [c.message.content for c in direct.choices]
    assert done.output_file_id in [f.id for f in oai.files.list(purpose="batch_output")]
    assert oai.files.delete(done.output_file_id).deleted
    assert done.output_file_id not in [f.id for f in oai.files.list(purpose="batch_output")]
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(done.output_file_id)
    [event] = poll(lambda: receiver.of(batch.id), 60.0, "the batch's webhook")
    assert event.type == "batch.completed" and [ok for _, _, ok in receiver.posts][:2] == [False, True]
    conn = connect(live_worker)
    try:
        poll(lambda: conn.xlen(Keys().webhook_outbox) == 0, 30.0, "the outbox emptied")
    finally:
        conn.close()


def test_a_conversation_on_a_cluster_keeps_its_items(oai: openai.OpenAI) -> None:
    conv = oai.conversations.create(items=[{"type": "message", "role": "user", "content": "Hello."}],
                                    metadata={"topic": "greeting"})
    assert oai.conversations.retrieve(conv.id).metadata == {"topic": "greeting"}
    oai.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "And again."}])
    assert [i.content[0].text for i in oai.conversations.items.list(conv.id, order="asc").data] == \
        ["Hello.", "And again."]
    assert oai.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        oai.conversations.retrieve(conv.id)


def test_a_pause_on_a_cluster_holds_jobs_in_the_queue_and_a_bad_checkpoint_is_taken_back(
    live_worker: str, served_model: str, http: httpx.Client, poll: Callable[..., Any], tiny_mistral_dir: Path,
) -> None:
    """The workers' command hashes, each written by one script (its count and fields together;
    a refused update taken back unless a later one came), are what the worker follows: paused,
    a job waits in the queue while beats go by; resumed, it is served. A checkpoint of another
    shape is refused by name and taken back."""
    conn = connect(live_worker)
    try:
        beat = lambda: decode_worker_info(conn.hgetall(Keys().worker(WORKER)))  # noqa: E731
        assert http.post("/pause", params={"mode": "wait"}, timeout=60).json() == {"status": "paused"}
        assert http.get("/is_paused").json() == {"is_paused": True}
        job = http.post("/v1/jobs", json={"prompt": "Once upon", "max_tokens": 4, "temperature": 0.0}).json()["id"]
        sent = time.time()
        poll(lambda: beat().heartbeat_at > sent + 1.0, 30, "two beats after the job")  # (0.5 s a beat)
        assert http.get(f"/v1/jobs/{job}").json()["status"] == "queued"
        assert http.post("/resume", timeout=60).json() == {"status": "resumed"}
        view = poll(lambda: (v := http.get(f"/v1/jobs/{job}").json())["status"] == "finished" and v, 60, "the job")
        assert view["outputs"][0]["text"] and http.get("/is_paused").json() == {"is_paused": False}
        refused = http.post("/update_weights_from_disk", json={"model_path": str(tiny_mistral_dir)}, timeout=60)
        assert refused.status_code == 400 and "taken back" in refused.json()["error"]["message"]
        assert conn.hget(Keys().weights(served_model), "model_path").decode() == ""  # (the model's own weights)
    finally:
        conn.close()


def test_a_message_batch_on_a_cluster_ends_and_is_deleted(
    served_model: str, api_url: str, poll: Callable[..., Any],
) -> None:
    """Anthropic's Message Batches API through its own client: the batch's rows and their
    index written in order, and deleted from both."""
    claude = anthropic.Anthropic(base_url=api_url, api_key="unused", max_retries=0, timeout=60)
    try:
        params = {"model": served_model, "messages": [{"role": "user", "content": "Say something."}],
                  "max_tokens": 4, "temperature": 0.0}
        batch = claude.messages.batches.create(requests=[{"custom_id": "one", "params": params}])
        done = poll(lambda: (b := claude.messages.batches.retrieve(batch.id)).processing_status == "ended" and b,
                    120.0, "the batch ended")
        assert done.request_counts.succeeded == 1
        [result] = claude.messages.batches.results(batch.id)
        assert result.custom_id == "one" and result.result.type == "succeeded"
        assert batch.id in [b.id for b in claude.messages.batches.list()]
        assert claude.messages.batches.delete(batch.id).type == "message_batch_deleted"
        with pytest.raises(anthropic.NotFoundError):
            claude.messages.batches.retrieve(batch.id)
        assert batch.id not in [b.id for b in claude.messages.batches.list()]
    finally:
        claude.close()
