"""Running batches (api.batches): each API process runs a `BatchRunner` that, for the batches
whose lease it holds, keeps at most `GENQ_BATCH_MAX_IN_FLIGHT` of their requests in the queue
and collects each request once its jobs end. Everything a batch needs is in Redis, so when an
API process dies another one takes its batches over once their lease lapses (a process that
stops gives its leases back at once). Each result is written with HSETNX, so a request is
counted once even if two processes collect it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import replace
from typing import Any

import redis

from api import files
from api.batches import ACTIVE, BatchObject, Line, parse_line, plan_line, read, save
from api.deps import AppState
from api.errors import APIError
from api.generate import Collector, Plan, job_ids, submit
from producer.protocol import JobStatus
from producer.redis_conn import ordered_writes

log = logging.getLogger("api.batch_runner")
LEASE_TTL_S = 10.0  # an API process that stops renewing loses its batches after this


class BatchRunner:
    """Drives the batches whose lease this API process holds (see the module docstring)."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        self.name = uuid.uuid4().hex  # this process, as lease holder
        self.leased: set[str] = set()

    async def run(self) -> None:
        """Until cancelled (the app stops); then the leases go back, for another API process
        to take over at once."""
        try:
            while True:
                try:
                    await self.tick()
                except (redis.RedisError, OSError) as exc:
                    log.warning("batch runner: Redis unavailable (%s); retrying", exc)
                except Exception:  # noqa: BLE001 - a bug in one batch must not stop the others
                    log.exception("batch runner: tick failed")
                await asyncio.sleep(self.state.settings.batch_poll_s)
        finally:
            await asyncio.shield(self._release())

    async def _release(self) -> None:
        keys, redis_ = self.state.client.keys, self.state.client.redis
        for batch_id in self.leased:
            try:
                if await redis_.get(keys.batch_lease(batch_id)) == self.name.encode():
                    await redis_.delete(keys.batch_lease(batch_id))
            except redis.RedisError:
                return  # they lapse by themselves

    async def tick(self) -> None:
        keys = self.state.client.keys
        for raw in await self.state.client.redis.smembers(keys.active_batches):
            batch_id = raw.decode()
            if not await self._lease(batch_id):
                continue
            try:
                await self.advance(batch_id)
            except redis.RedisError:
                raise
            except Exception:  # noqa: BLE001 - one batch's bug must not stall the others
                log.exception("batch %s: advancing it failed; retrying next tick", batch_id)

    async def _lease(self, batch_id: str) -> bool:
        """Take the batch's lease, or renew it if it is ours."""
        key, ttl_ms = self.state.client.keys.batch_lease(batch_id), int(LEASE_TTL_S * 1000)
        redis_ = self.state.client.redis
        if await redis_.set(key, self.name, nx=True, px=ttl_ms):
            self.leased.add(batch_id)
            return True
        if await redis_.get(key) == self.name.encode():
            await redis_.pexpire(key, ttl_ms)
            return True
        self.leased.discard(batch_id)
        return False

    async def advance(self, batch_id: str) -> None:
        """Collect what ended, submit more (or cancel what runs, when stopping), finish."""
        keys, redis_ = self.state.client.keys, self.state.client.redis
        batch = await read(self.state, batch_id)
        if batch.status not in ACTIVE:
            await redis_.srem(keys.active_batches, batch_id)
            return
        in_flight = {m.decode() for m in await redis_.smembers(keys.batch_in_flight(batch_id))}
        next_line = int(await redis_.hget(keys.batch(batch_id), "next") or 0)
        await self._collect(batch, in_flight)
        stopping = batch.status == "cancelling" or time.time() > (batch.expires_at or 0)
        if stopping:
            await self._cancel_jobs(batch_id, in_flight)
        else:
            next_line = await self._submit_more(batch, in_flight, next_line)
        if not in_flight and (stopping or next_line >= batch.request_counts.total):
            await self._finish(batch, next_line)

    async def _submit_more(self, batch: BatchObject, in_flight: set[str], next_line: int) -> int:
        """Lines in order from `next_line`, until `batch_max_in_flight` are in the queue;
        returns the next line then. Each is marked in flight before it is submitted, so a
        process that dies in between leaves a line that `_collect` submits again (submitting
        is idempotent), never one that is lost."""
        keys, redis_ = self.state.client.keys, self.state.client.redis
        room = self.state.settings.batch_max_in_flight - len(in_flight)
        texts = await redis_.lrange(keys.batch_lines(batch.id), next_line, next_line + room - 1) if room > 0 else []
        tenant = await self._tenant(batch.id) if texts else None
        for number, text in enumerate(texts, next_line):
            line = parse_line(text.decode(), batch.endpoint, self.state.settings)
            model = line.body.model or self.state.settings.served_model_name
            defaults = await self.state.cluster.sampling_defaults(model)
            try:
                planned = replace(plan_line(self.state, line, batch.id, number, defaults), tenant=tenant)
            except APIError as exc:  # the deployment changed since the batch was checked
                await self._store(batch, number, False, _refused(line, exc))
                await redis_.hset(keys.batch(batch.id), "next", number + 1)
                continue
            member = f"{number}:{len(planned.req.job_ids)}"
            await redis_.sadd(keys.batch_in_flight(batch.id), member)
            await submit(self.state, planned)
            await redis_.hset(keys.batch(batch.id), "next", number + 1)
            in_flight.add(member)
        return next_line + len(texts)

    async def _collect(self, batch: BatchObject, in_flight: set[str]) -> None:
        """Every line whose jobs have all ended: its output line, once."""
        client = self.state.client
        members = sorted(in_flight)
        job_ids = {m: _job_ids(batch.id, m) for m in members}
        pipe = client.redis.pipeline(transaction=False)
        for member in members:
            for job_id in job_ids[member]:
                pipe.hget(client.keys.job(job_id), "status")
        statuses = iter(await pipe.execute())
        for member in members:
            found = [next(statuses) for _ in job_ids[member]]
            if all(s is not None and JobStatus(s.decode()).terminal for s in found):
                await self._record(batch, member)
                in_flight.discard(member)
            elif None in found:  # marked in flight by a process that died before submitting
                await self._resubmit(batch, member)

    async def _resubmit(self, batch: BatchObject, member: str) -> None:
        _, planned = await self._line(batch, member)
        await submit(self.state, replace(planned, tenant=await self._tenant(batch.id)))

    async def _tenant(self, batch_id: str) -> str | None:
        """The key that created the batch (its lines are metered to it), if keys are on."""
        tenant = await self.state.client.redis.hget(self.state.client.keys.batch(batch_id), "tenant")
        return tenant.decode() if tenant else None

    async def _line(self, batch: BatchObject, member: str) -> tuple[Line, Plan]:
        """An in-flight line, `number:jobs`, and its plan."""
        number = int(member.split(":")[0])
        text = await self.state.client.redis.lindex(self.state.client.keys.batch_lines(batch.id), number)
        line = parse_line(text.decode(), batch.endpoint, self.state.settings)
        return line, plan_line(self.state, line, batch.id, number)

    async def _record(self, batch: BatchObject, member: str) -> None:
        line, planned = await self._line(batch, member)
        ok, output = await self._output(line, planned, batch)
        await self._store(batch, int(member.split(":")[0]), ok, output, member)

    async def _store(
        self, batch: BatchObject, number: int, ok: bool, output: dict[str, Any], member: str | None = None
    ) -> None:
        """A line's output, once (HSETNX), counted once; the line leaves the in-flight set."""
        client = self.state.client
        pipe = ordered_writes(client.redis)
        pipe.hsetnx(client.keys.batch_results(batch.id), str(number), json.dumps({"ok": ok, "line": output}))
        pipe.expire(client.keys.batch_results(batch.id), self.state.settings.file_ttl_s)
        if member is not None:
            pipe.srem(client.keys.batch_in_flight(batch.id), member)
        first = (await pipe.execute())[0]
        if first:
            await client.redis.hincrby(client.keys.batch(batch.id), "completed" if ok else "failed", 1)
            if not ok and output.get("response") is None:  # of the failed, cancelled or expired before it ended
                await client.redis.hincrby(client.keys.batch(batch.id), "stopped", 1)

    async def _output(self, line: Line, planned: Plan, batch: BatchObject) -> tuple[bool, dict[str, Any]]:
        """The line's output: the response body, or its error, as OpenAI writes them."""
        req = planned.req
        collector = Collector(req)
        cancelled = False
        for job_id in req.job_ids:
            record, events = await self.state.relay.snapshot(job_id)
            cancelled = cancelled or record.status == JobStatus.CANCELLED
            for event in events:
                collector.add(job_id, event)
        entry: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id}
        if collector.error is not None:
            status, kind, code = collector.error_kind()
            error = {"message": collector.error, "type": kind, "param": None, "code": code}
            return False, {**entry, "response": {"status_code": status, "request_id": req.id, "body": {"error": error}}, "error": None}
        if cancelled:
            code = "batch_cancelled" if batch.status == "cancelling" else "batch_expired"
            return False, {**entry, "response": None, "error": {"code": code, "message": f"the batch was {code[6:]} before this request ended"}}
        rendered = line.endpoint.renderer().response(req, collector.choices, collector.usage())
        body = line.endpoint.respond(line.request, rendered)
        return True, {**entry, "response": {"status_code": 200, "request_id": req.id, "body": body}, "error": None}

    async def _cancel_jobs(self, batch_id: str, in_flight: set[str]) -> None:
        """Once per batch: a cancel flag lasts, and a line submitted again later has the same
        job ids, so its intake finds the flag too."""
        if not await self.state.client.redis.hsetnx(self.state.client.keys.batch(batch_id), "cancel_sent", 1):
            return
        for member in in_flight:
            for job_id in _job_ids(batch_id, member):
                await self.state.client.cancel(job_id)

    async def _finish(self, batch: BatchObject, next_line: int) -> None:
        """Write the output and error files, in line order, and end the batch."""
        client, settings = self.state.client, self.state.settings
        results = await client.redis.hgetall(client.keys.batch_results(batch.id))
        ordered = [json.loads(results[k]) for k in sorted(results, key=int)]
        now = int(time.time())
        for ok, attr in ((True, "output_file_id"), (False, "error_file_id")):
            lines = [json.dumps(r["line"]) for r in ordered if r["ok"] == ok]
            if lines:
                stored = await files.store(
                    client, ("\n".join(lines) + "\n").encode(), f"{batch.id}_{attr[:-8]}.jsonl",
                    "batch_output", settings.file_ttl_s,
                )
                setattr(batch, attr, stored.id)
        if batch.status == "cancelling":
            batch.status, batch.cancelled_at = "cancelled", now
        elif next_line < batch.request_counts.total or time.time() > (batch.expires_at or 0):
            batch.status, batch.expired_at = "expired", now
        else:
            batch.status, batch.finalizing_at, batch.completed_at = "completed", now, now
        await save(self.state, batch)
        pipe = ordered_writes(client.redis)
        pipe.srem(client.keys.active_batches, batch.id)
        pipe.delete(client.keys.batch_results(batch.id), client.keys.batch_lines(batch.id), client.keys.batch_lease(batch.id))
        await pipe.execute()
        await self.state.webhooks.ended("batch", batch.id, batch.status)


def _refused(line: Line, exc: APIError) -> dict[str, Any]:
    """The output of a line the endpoint refuses now, as its response would be."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": exc.status_code, "request_id": None, "body": exc.body()}, "error": None}


def _job_ids(batch_id: str, member: str) -> list[str]:
    """The job ids of an in-flight line, `number:jobs`, as `plan` names them."""
    number, count = (int(x) for x in member.split(":"))
    return job_ids(f"{batch_id}-{number}", count)
