"""OpenAI's webhooks (api.webhooks) against a live stack and a receiver of the test's own:
background responses and batches that end are announced once each, signed so that OpenAI's
own SDK (`client.webhooks.unwrap`) verifies and reads them, retried while the receiver fails,
and sent by another API process when the one that saw the end could not."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
from batch_support import chat_line, run_batch, wait_done
from webhook_support import SECRET, Receiver

from api.settings import Settings
from producer.protocol import Keys


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()  # the first event's first attempt fails: it is sent again
    yield receiver
    receiver.server.shutdown()


@pytest.fixture(scope="module")
def client(live_worker: str, serve_api, receiver: Receiver) -> Iterator[openai.OpenAI]:
    settings = Settings(redis_url=live_worker, webhook_url=receiver.url, webhook_secret=SECRET,
                        request_timeout_s=60.0, batch_poll_s=0.1)
    with serve_api(settings) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_an_event_one_api_process_could_not_send_is_sent_by_another(
    live_worker: str, serve_api, served_model: str, poll: Callable[..., Any],
) -> None:
    """(First in the module: no other API process sends webhooks yet.) One whose receiver is
    unreachable ends a background response, fails to send its event and stops; the event waits
    in the outbox in Redis, and the next API process sends it."""
    unreachable = Settings(redis_url=live_worker, webhook_url="http://127.0.0.1:9/hooks", webhook_secret=SECRET,
                           request_timeout_s=60.0)
    with serve_api(unreachable) as url:
        other = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        queued = other.responses.create(model=served_model, input="Hi.", background=True, max_output_tokens=2)
        poll(lambda: other.responses.retrieve(queued.id).status == "incomplete", 30.0, "the response's end")
        poll(lambda: "genq:webhook_events_unsent 1.0" in unsent(url), 30.0, "the event waiting")
    later = Receiver()
    conn = redis.Redis.from_url(live_worker)
    try:
        settings = Settings(redis_url=live_worker, webhook_url=later.url, webhook_secret=SECRET, webhook_sender_ttl_s=1.0)
        with serve_api(settings) as url:
            [event] = poll(lambda: later.of(queued.id), 30.0, "the event, from the outbox")
            poll(lambda: "genq:webhook_events_unsent 0.0" in unsent(url), 30.0, "the outbox emptied")
            # the stopped process's sender, its event taken over, leaves the group; the live one stays
            poll(lambda: len(conn.xinfo_consumers(Keys().webhook_outbox, Keys().webhook_senders)) == 1, 30.0,
                 "the stopped sender dropped")
    finally:
        later.server.shutdown()
        conn.close()
    assert event.type == "response.incomplete"


def unsent(url: str) -> list[str]:
    return httpx.get(f"{url}/metrics", timeout=30).text.splitlines()


def test_a_background_response_that_ends_is_announced_once(client: openai.OpenAI, receiver: Receiver,
                                                           served_model: str, poll: Callable[..., Any]) -> None:
    queued = client.responses.create(model=served_model, input="Say hi.", background=True, max_output_tokens=4)
    [event] = poll(lambda: receiver.of(queued.id), 30.0, "the response's event")
    assert event.type == "response.incomplete" and event.object == "event"  # (4 tokens: cut short)
    assert client.responses.retrieve(queued.id).status == "incomplete"  # a GET that sees the end again
    attempts = [h for h, body, _ in receiver.posts if json.loads(body)["data"]["id"] == queued.id]
    assert len(attempts) == 2 and attempts[0]["webhook-id"] == attempts[1]["webhook-id"]  # the retry
    assert len(receiver.of(queued.id)) == 1

    long = client.responses.create(model=served_model, input="Count to a thousand.", background=True,
                                   max_output_tokens=900, extra_body={"ignore_eos": True})
    assert client.responses.cancel(long.id).status == "cancelled"
    [event] = poll(lambda: receiver.of(long.id), 30.0, "the cancelled response's event")
    assert event.type == "response.cancelled"


def test_batches_that_end_are_announced(client: openai.OpenAI, receiver: Receiver, served_model: str,
                                        poll: Callable[..., Any]) -> None:
    done = wait_done(client, run_batch(client, [chat_line("a", served_model), chat_line("b", served_model)]).id, poll)
    assert done.status == "completed"
    [event] = poll(lambda: receiver.of(done.id), 30.0, "the batch's event")
    assert event.type == "batch.completed"
    refused = run_batch(client, [{"custom_id": "x", "method": "GET", "url": "/v1/chat/completions", "body": {}}])
    assert refused.status == "failed"
    [event] = poll(lambda: receiver.of(refused.id), 30.0, "the failed batch's event")
    assert event.type == "batch.failed"
    with pytest.raises(openai.InvalidWebhookSignatureError):  # the signature is the secret's
        other_event_headers, body = receiver.posts[0][0], receiver.posts[-1][1]
        openai.OpenAI(api_key="unused", webhook_secret=SECRET).webhooks.unwrap(body, other_event_headers)


def test_a_webhook_url_needs_a_secret() -> None:
    with pytest.raises(ValueError, match="GENQ_WEBHOOK_URL needs GENQ_WEBHOOK_SECRET"):
        Settings(webhook_url="http://127.0.0.1:1/hooks")
    with pytest.raises(ValueError, match="whsec_ followed by base64"):
        Settings(webhook_url="http://127.0.0.1:1/hooks", webhook_secret="whsec_!!!")
