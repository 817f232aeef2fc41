"""The job endpoints' work: read a job's record, build its view, stream its events as SSE
with ids a client can resume from (`Last-Event-ID`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import asdict
from typing import Any

from api.errors import invalid_param, not_found
from api.relay import Relay
from api.render import Choice
from api.response_bodies import JobOutput, JobView, Usage
from api.sse import DONE, format_sse
from producer.async_client import AsyncClient
from producer.jobs import JobLost, JobNotFound
from producer.protocol import Event, unpack_embedding
from producer.records import JobRecord, decode_record


async def read_record(client: AsyncClient, job_id: str) -> JobRecord:
    """The job hash, decoded; 404 when there is none (never submitted, or expired)."""
    raw = await client.redis.hgetall(client.keys.job(job_id))
    if not raw:
        raise job_not_found(job_id)
    return decode_record(raw, job_id)


def job_not_found(job_id: str) -> Exception:
    message = f"No job {job_id!r} (never submitted, or expired after it ended)."
    return not_found(message, "job_not_found")


async def job_view(client: AsyncClient, relay: Relay, job_id: str) -> JobView:
    """Status always; outputs and usage once the job has ended (from the record, else from
    its events)."""
    record = await read_record(client, job_id)
    view = record_view(job_id, record)
    if record.status is None or not record.status.terminal:
        return view
    usage = record.usage
    view.embedding = record.embedding
    if record.outputs is not None:
        view.outputs = [JobOutput(**asdict(o)) for o in record.outputs]
    else:  # the worker stored no outputs: assemble them from the events
        try:
            record, events = await relay.snapshot(job_id)
        except JobNotFound:
            raise job_not_found(job_id) from None
        view.outputs = _outputs(events, record.n or 1)
        usage = usage or next((e.usage for e in reversed(events) if e.usage), None)
    view.usage = Usage.from_protocol(usage) if usage else None
    return view


def record_view(job_id: str, record: JobRecord) -> JobView:
    return JobView(
        id=job_id, status=record.status.value if record.status else "queued", n=record.n or 1,
        worker=record.worker, submitted_at=record.submitted_at, started_at=record.started_at,
        finished_at=record.finished_at, error=record.error, error_type=record.error_type,
    )


def _outputs(events: list[Event], n: int) -> list[JobOutput]:
    choices = [Choice(i) for i in range(max([n - 1, *(e.index for e in events)]) + 1)]
    for event in events:
        choices[event.index].add(event)
    return [
        JobOutput(index=c.index, text=c.text, token_ids=c.token_ids,
                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        for c in choices
    ]


def parse_last_event_id(value: str | None) -> tuple[int, int] | None:
    """`seq` or `index:seq` -> (index, seq); 400 for anything else."""
    if value is None or not value.strip():
        return None
    index, _, seq = value.strip().rpartition(":")
    try:
        parsed = (int(index) if index else 0, int(seq))
    except ValueError:
        parsed = (-1, -1)
    if min(parsed) < 0:
        message = f"Last-Event-ID must be 'seq' or 'index:seq', got {value!r}"
        raise invalid_param("Last-Event-ID", message)
    return parsed


def event_id(event: Event, n: int) -> str:
    return f"{event.index}:{event.seq}" if n > 1 else str(event.seq)


def event_data(event: Event) -> dict[str, Any]:
    data = {k: v for k, v in asdict(event).items() if v is not None}
    if event.embedding is not None:  # an embedding job's vector, as JSON numbers
        data["embedding"] = unpack_embedding(event.embedding)
    return data


async def event_stream(
    relay: Relay, job_id: str, n: int, resume: tuple[int, int] | None, timeout_s: float
) -> AsyncGenerator[str, None]:
    """The job's events from `resume` on, then `data: [DONE]`. The job is not cancelled when
    the client goes: it can come back with Last-Event-ID. After `timeout_s` the stream ends
    without [DONE], so an EventSource reconnects and resumes. A job Redis lost meanwhile (its
    record vanished) ends with an error event, `error_type` `job_lost`."""
    try:
        async with aclosing(relay.follow([job_id], resume=resume, timeout_s=timeout_s)) as events:
            async for _, event in events:
                yield format_sse(event_data(event), event_id(event, n))
    except TimeoutError:
        yield ": timeout, reconnect with Last-Event-ID to resume\n\n"
        return
    except JobLost as exc:  # Redis lost it mid-stream: say so, as a failed job's error event would
        yield format_sse({"error": str(exc), "error_type": "job_lost"})
    yield DONE
