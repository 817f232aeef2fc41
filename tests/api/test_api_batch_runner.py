"""Batches driven by API processes with their own settings (one request in flight at a time,
a runner that stopped), each test with apps of its own: no other API process may take its
batches' leases."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import redis
from batch_support import chat_line, read_file, run_batch, wait_done

from api.settings import Settings
from producer.protocol import Keys


def test_cancelling_stops_a_batch_and_keeps_what_finished(
    served_model: str, live_worker: str, serve_api, poll: Callable[..., Any]
) -> None:
    """One request in the queue at a time (GENQ_BATCH_MAX_IN_FLIGHT=1): cancelled while its
    first long request runs, the batch never starts the others."""
    settings = Settings(redis_url=live_worker, batch_max_in_flight=1, batch_poll_s=0.05)
    with serve_api(settings) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        lines = [chat_line(f"long-{i}", served_model, max_tokens=900) for i in range(4)]
        batch = run_batch(client, lines)
        poll(lambda: _running_jobs(client, batch.id), 30, "first request running")
        assert client.batches.cancel(batch.id).status == "cancelling"
        done = wait_done(client, batch.id, poll)
        assert done.status == "cancelled" and done.cancelled_at is not None
        errors = read_file(client, done.error_file_id)
        assert set(errors) == {"long-0"} and errors["long-0"]["error"]["code"] == "batch_cancelled"
        assert done.output_file_id is None and done.request_counts.failed == 1
        client.close()


def _running_jobs(client: openai.OpenAI, batch_id: str) -> bool:
    """The batch's first request has begun (its job, through the job endpoint)."""
    try:
        response = client.get(f"/jobs/{batch_id}-0", cast_to=object)
    except openai.NotFoundError:
        return False  # not submitted yet
    return isinstance(response, dict) and response.get("status") == "running"


def test_another_api_process_takes_a_batch_over(
    served_model: str, live_worker: str, serve_api, poll: Callable[..., Any]
) -> None:
    settings = Settings(redis_url=live_worker, batch_max_in_flight=1)
    lines = [chat_line(f"r{i}", served_model) for i in range(3)]
    with serve_api(settings) as first:
        client = openai.OpenAI(base_url=f"{first}/v1", api_key="unused", max_retries=0)
        batch = run_batch(client, lines)
        client.close()
    with serve_api(settings) as second:  # the first one stopped mid-batch and gave its lease back
        client = openai.OpenAI(base_url=f"{second}/v1", api_key="unused", max_retries=0)
        done = wait_done(client, batch.id, poll)
        assert done.status == "completed" and set(read_file(client, done.output_file_id)) == {"r0", "r1", "r2"}
        client.close()


def test_a_line_marked_in_flight_but_never_submitted_is_submitted_again(
    served_model: str, live_worker: str, serve_api, poll: Callable[..., Any]
) -> None:
    """What an API process that died between marking a line and submitting it leaves behind."""
    conn = redis.Redis.from_url(live_worker)
    keys = Keys()
    idle = Settings(redis_url=live_worker, batch_poll_s=3600)  # its runner looks once, at start
    with serve_api(idle) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        batch = run_batch(client, [chat_line("only", served_model)])
        client.close()
        metrics = httpx.get(f"{url}/metrics").text  # created, and nobody drives it yet
        assert "genq:batches_active 1.0" in metrics.splitlines()
    conn.hset(keys.batch(batch.id), "next", 1)  # marked in flight, then the process died
    conn.sadd(keys.batch_in_flight(batch.id), "0:1")
    assert not conn.exists(keys.job(f"{batch.id}-0"))
    with serve_api(Settings(redis_url=live_worker, batch_poll_s=0.05)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        done = wait_done(client, batch.id, poll)
        assert done.status == "completed" and set(read_file(client, done.output_file_id)) == {"only"}
        client.close()
    conn.close()


def test_a_batch_past_its_window_expires_with_what_finished(
    served_model: str, live_worker: str, serve_api, poll: Callable[..., Any]
) -> None:
    """The 24 h window, passed by rewriting expires_at: the request running then is cancelled
    and reported as expired; the batch ends `expired`."""
    conn = redis.Redis.from_url(live_worker)
    keys = Keys()
    with serve_api(Settings(redis_url=live_worker, batch_max_in_flight=1, batch_poll_s=0.05)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        batch = run_batch(client, [chat_line(f"long-{i}", served_model, max_tokens=900) for i in range(3)])
        poll(lambda: _running_jobs(client, batch.id), 30, "first request running")
        stored = json.loads(conn.hget(keys.batch(batch.id), "object"))
        conn.hset(keys.batch(batch.id), "object", json.dumps({**stored, "expires_at": int(time.time()) - 1}))
        done = wait_done(client, batch.id, poll)
        assert done.status == "expired" and done.expired_at is not None
        errors = read_file(client, done.error_file_id)
        assert set(errors) == {"long-0"} and errors["long-0"]["error"]["code"] == "batch_expired"
        client.close()
    conn.close()


def test_a_line_the_deployment_refuses_by_the_time_it_runs_goes_to_the_error_file(
    served_model: str, live_worker: str, serve_api, poll: Callable[..., Any]
) -> None:
    """Checked under GENQ_TOOL_CALL_PARSER=hermes, run where it is `none`: the line with
    tool_choice "auto" is refused as that endpoint would refuse it; the others run."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    lines = [chat_line("tools", served_model, tools=[tool]), chat_line("plain", served_model)]
    with serve_api(Settings(redis_url=live_worker, batch_poll_s=3600)) as url:  # checks, does not run
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        batch = run_batch(client, lines)
        client.close()
    assert batch.status == "in_progress"
    with serve_api(Settings(redis_url=live_worker, batch_poll_s=0.05, tool_call_parser="none")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        done = wait_done(client, batch.id, poll)
        assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (1, 1)
        refused = read_file(client, done.error_file_id)["tools"]["response"]
        assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "tool_choice"
        assert set(read_file(client, done.output_file_id)) == {"plain"}
        client.close()


def test_an_upload_over_the_limit_is_refused(live_worker: str, serve_api) -> None:
    with serve_api(Settings(redis_url=live_worker, max_file_bytes=1000)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            client.files.create(file=("big.jsonl", b"x" * 1001), purpose="batch")
        assert info.value.status_code == 413 and info.value.body["code"] == "file_too_large"
        assert client.files.create(file=("ok.jsonl", b"x" * 1000), purpose="batch").bytes == 1000
        client.close()
