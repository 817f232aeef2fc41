"""Publishing: engine step results -> one Redis round trip.

The publisher takes every step result waiting in the engine thread's queue (one when Redis
keeps up, several when it lags), turns them into per-job writes (new events; for finished
jobs also the record and the XACK) and sends them in one STEP_LUA call. While that call is
in flight the engine computes the next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from producer.aio import wait_within
from producer.protocol import encode_event
from producer.redis_conn import REDIS_AWAY
from producer.trace_log import TraceLog
from worker.queue.engine_thread import EngineStats, EngineThread, Rejected, StepResult
from worker.queue.jobs import (
    ABORT_DEADLINE,
    HeldJob,
    JobState,
    JobTable,
    ShardTurns,
    TenantTokens,
    TokenRate,
    coalescing_interval_s,
    final_record,
    hold_delta,
    job_meter,
    publish_due,
    unsent_events,
)
from worker.queue.metrics import WorkerMetrics
from worker.queue.outage import REDIS_ERRORS, Outage
from worker.queue.scripts import JobWrite, PartlyPublished, Scripts

if TYPE_CHECKING:
    from worker.core.outputs import RequestOutput

logger = logging.getLogger(__name__)

RETRY_DELAY_S = 0.5  # Redis unreachable: retry the same writes
# Writes Redis answered this long before an outage are made again after it, before the failed
# ones: what a master killed had not yet sent its replica (replication is asynchronous; the
# promoted replica lacks it) or a restarted Redis had not yet written to disk (appendfsync
# everysec loses up to about 2 s) would otherwise be a hole in a job's events.
RESEND_WINDOW_S = 2.0


class EngineFailed(RuntimeError):
    """The engine thread raised; the worker must stop (its entries will be reclaimed)."""


class Publisher:
    def __init__(
        self,
        scripts: Scripts,
        table: JobTable,
        engine: EngineThread,
        metrics: WorkerMetrics,
        worker_name: str,
        on_rejected: Callable[[HeldJob, Rejected], Any],
        model_name: str = "",
        stream_interval_ms: float = 0.0,
        trace: TraceLog | None = None,
        coalesce_min_tokens_per_s: float = 0.0,
    ) -> None:
        self.scripts = scripts
        self.trace = trace  # the per-step trace (None: off): a line per publish, a time on each event
        self.table = table
        self.engine = engine
        self.metrics = metrics
        self.worker_name = worker_name
        self.model_name = model_name  # what usage is metered under when a job names no model
        self.on_rejected = on_rejected  # async: fail the job, dead-letter its entry
        self.stats = EngineStats()
        # what the engine made of the commands it follows: as built, then as of the outputs
        # written (a pause, a sleep, a weights update "wait" is said after the jobs it ended)
        self.commands = engine.made()
        self._made_before = self._commands_made()
        # set once the engine made a command (a pause, sleep, weights update, adapters): the
        # heartbeat says so at once, so whoever waits on it hears now, not a heartbeat later
        self.made = asyncio.Event()
        self.changed = asyncio.Event()  # set after each batch: capacity may have grown
        self.idle = asyncio.Event()  # set while no result waits to be published
        self.outage = Outage("publishing")
        # coalesced events: a job's new tokens go out about every stream_interval_s, on its
        # shard's turn (jobs.publish_due, jobs.ShardTurns); the jobs holding unsent tokens, for
        # the timer that sends them when no step comes in time (a preempted job, a frozen pause)
        self.stream_interval_s = stream_interval_ms / 1000
        self._turns = ShardTurns(scripts.keys.shards)
        # ... while the worker makes at least this many tokens a second; below, every step publishes
        self.coalesce_min_tokens_per_s = coalesce_min_tokens_per_s
        self._rate = TokenRate()
        self._holding: dict[str, HeldJob] = {}
        self._step_s = 0.0  # the engine's last step: between the last two results with outputs
        self._step_at: float | None = None
        self._writing = asyncio.Lock()  # one STEP_LUA call at a time: a job's events stay in seq order
        self._answered: deque[tuple[float, list[JobWrite]]] = deque()  # (when, writes): the last RESEND_WINDOW_S

    async def run(self) -> None:
        """Publish until cancelled; raises EngineFailed if the engine thread died."""
        results = self.engine.results
        while True:
            self.idle.set()
            first = await self._next_result()
            self.idle.clear()
            if first is None:
                await self.publish_held(time.time())
                continue
            batch = [first]
            while not results.empty():
                batch.append(results.get_nowait())
            await self.publish(batch)

    async def _next_result(self) -> StepResult | None:
        """The next step result; None when a held job's interval ended first."""
        due_at = self._turns.next_at(self.stream_interval_s) if self._holding else None
        if due_at is None:
            return await self.engine.results.get()
        try:
            return await wait_within(self.engine.results.get(), due_at - time.time())
        except TimeoutError:
            return None

    async def publish_held(self, now: float, jobs: list[HeldJob] | None = None, retry: bool = True) -> None:
        """Send the held tokens of `jobs` (default: those of the shards whose turn has come by
        `now`), whatever their state: a job released at a drain leaves its tokens in its stream
        for the worker that resumes it. `retry` False: one try, Redis errors raised (a drain)."""
        writes: dict[str, JobWrite] = {}
        if jobs is None:
            self._take_turns(self._turns.due(now, self.stream_interval_s, 0.0), now, writes)
        else:
            for held in jobs:
                if held.unsent:
                    self._take_unsent(held, now, writes)
                self._holding.pop(held.id, None)
            self._turns.keep((h.shard for h in self._holding.values()), set())
        called_s = time.time()
        await self._write(list(writes.values()), retry)
        if self.trace is not None and writes:
            self._trace_publish("publish_held", [now], called_s, writes)

    async def publish(self, batch: list[StepResult]) -> None:
        writes: dict[str, JobWrite] = {}
        rejected: list[tuple[HeldJob, Rejected]] = []
        for result in batch:
            if result.error is not None:
                raise EngineFailed(f"engine thread failed: {result.error!r}") from result.error
            self._note_step(result)
            interval_s = coalescing_interval_s(self.stream_interval_s, self._rate, self.coalesce_min_tokens_per_s,
                                               self._step_s)
            tokens = sum(self._apply(output, result.time, writes, interval_s) for output in result.outputs)
            if self._holding:  # the jobs of the shards whose turn it is, those this step left out too
                self._take_turns(self._turns.due(result.time, interval_s, self._step_s), result.time, writes)
            else:
                self._turns.keep((), set())  # (nothing held: a shard that holds again starts afresh)
            self._rate.add(result.time, tokens)
            rejected += self._rejected(result.rejected)
            self.stats = result.stats
        called_s = time.time()
        await self._write(list(writes.values()))
        if self.trace is not None:
            self._trace_publish("publish", [r.time for r in batch], called_s, writes)
        self.commands = self.stats.made
        if (made := self._commands_made()) != self._made_before:
            self._made_before = made
            self.made.set()
        for held, refused in rejected:
            await self.on_rejected(held, refused)
        self.metrics.engine_stats(self.stats)
        self.changed.set()

    def _trace_publish(self, kind: str, steps: list[float], called_s: float, writes: dict[str, JobWrite]) -> None:
        """The publish's line in the trace: the step results it carried (their end times), how
        long they waited for the publisher (queue_ms) and its Redis call (call_ms), and from the
        last step's end to the call's return (delay_ms)."""
        done_s = time.time()
        assert self.trace is not None
        self.trace.write(kind, steps=steps, called=called_s, done=done_s,
                         queue_ms=round((called_s - max(steps)) * 1000, 3),
                         call_ms=round((done_s - called_s) * 1000, 3), delay_ms=round((done_s - max(steps)) * 1000, 3),
                         jobs=len(writes), events=sum(len(w.events) for w in writes.values()))

    def _note_step(self, result: StepResult) -> None:
        """How long the engine's steps take now (for the shards' turns' look one step ahead)."""
        if not result.outputs:
            return
        if self._step_at is not None:
            self._step_s = max(0.0, result.time - self._step_at)
        self._step_at = result.time

    def _commands_made(self) -> tuple[Any, ...]:
        """What the engine made of the commands it follows, as the heartbeat says it."""
        adapters = self.engine.adapters
        return self.commands, tuple(adapters.served), tuple(adapters.errors)

    def _take_turns(self, shards: set[int], now: float, writes: dict[str, JobWrite]) -> None:
        """Move the held tokens of the `shards` whose turn it is into their writes; a job
        dropped meanwhile only leaves the holders."""
        for held in [h for h in self._holding.values() if h.shard in shards]:
            if held.state.writes and held.unsent:
                self._take_unsent(held, now, writes)
            self._holding.pop(held.id, None)
        self._turns.keep((h.shard for h in self._holding.values()), shards)

    def _apply(self, output: RequestOutput, now: float, writes: dict[str, JobWrite], interval_s: float) -> int:
        """Fold one engine output into the job's pending write; returns its new tokens."""
        found = self.table.by_engine_id(output.request_id)
        if found is None:
            return 0  # dropped earlier (lost or released), or already failed
        held, fixed_index = found
        if output.finished:
            self.table.engine_done(held, output.request_id)
        if not held.state.writes:
            if not held.engine_ids:
                self.table.remove(held)
            return 0
        counted = self._note_prompt(held, output)  # what this output adds to the tenant's minute
        num_new = 0
        for delta in output.outputs:
            index = delta.index if fixed_index is None else fixed_index
            num_new += hold_delta(held, index, delta.text, list(delta.token_ids), delta.finish_reason,
                                  delta.stop_reason, _wire_logprobs(delta.logprobs), delta.token_timestamps)
        self.metrics.tokens(held, num_new, now)
        if held.job.tenant:
            held.unsent_tenant_tokens += counted + num_new
        if publish_due(held, interval_s):
            self._take_unsent(held, now, writes)
        elif held.unsent:  # (sent on its shard's turn, this step's or a later one's, or by the timer)
            self._holding[held.id] = held
            self._turns.holding(held.shard, now - self._step_s, interval_s)
        if held.finished:
            write = writes.setdefault(held.id, JobWrite(held.id, held.entry_id))
            write.record = final_record(held, self.worker_name, now)
            write.meter = job_meter(held, self.model_name, now)
        elif held.abort_reason is None and held.past_deadline(now):
            self._abort_expired(held)
        return num_new

    def _take_unsent(self, held: HeldJob, now: float, writes: dict[str, JobWrite]) -> None:
        """Move the job's held deltas into its pending write, one event per completion."""
        write = writes.setdefault(held.id, JobWrite(held.id, held.entry_id))
        events = unsent_events(held)
        if self.trace is not None:  # (for the API's relay trace: the step it comes from)
            for event in events:
                event.time = now
        write.events += [encode_event(e) for e in events]
        if held.unsent_tenant_tokens:
            before = write.tenant_tokens.tokens if write.tenant_tokens else 0
            write.tenant_tokens = TenantTokens(held.job.tenant or "", int(now // 60), before + held.unsent_tenant_tokens)
            held.unsent_tenant_tokens = 0
        self._holding.pop(held.id, None)

    def _note_prompt(self, held: HeldJob, output: RequestOutput) -> int:
        """What the job's outputs say of its prompt, kept for its events (its token count the
        first time: returned, for the tenant's minute)."""
        counted = 0
        if held.prompt_tokens is None:
            held.prompt_tokens = counted = output.num_prompt_tokens or 0
            self.metrics.prompt_tokens(held.prompt_tokens)
            if held.job.return_prompt_token_ids:
                held.prompt_token_ids = list(output.prompt_token_ids)
        held.cached_tokens = max(held.cached_tokens, output.num_cached_tokens)
        if output.embedding is not None:
            held.embedding = output.embedding  # sent with the final event, and kept in the record
        if output.prompt_logprobs is not None and held.completions[0].next_seq == 0:
            held.prompt_logprobs = self._wire_prompt_logprobs(
                output.prompt_token_ids, output.prompt_logprobs
            )
            held.prompt_text = output.prompt
        return counted

    def _wire_prompt_logprobs(
        self, prompt_token_ids: list[int], prompt_logprobs: list[Any]
    ) -> list[dict[str, Any]]:
        """The engine's prompt logprobs on the wire, each with its token id (a text prompt's
        ids are known only here). The first token has no logprob (nothing comes before it),
        but readers that show the prompt token by token need its text."""
        first = {"token_id": prompt_token_ids[0],
                 "token": self.engine.engine.tokenizer.decode(prompt_token_ids[:1])}
        rest = _wire_logprobs(prompt_logprobs[1:]) or []
        for token_id, entry in zip(prompt_token_ids[1:], rest, strict=True):
            entry["token_id"] = token_id
        return [first, *rest]

    def _abort_expired(self, held: HeldJob) -> None:
        """Deadline passed mid-run: abort at the next step (the heartbeat catches jobs that
        produce nothing, such as ones still waiting)."""
        held.abort_reason = ABORT_DEADLINE
        self.engine.abort(sorted(held.engine_ids))

    def _rejected(self, rejected: list[Rejected]) -> list[tuple[HeldJob, Rejected]]:
        """Jobs the engine refused (prompt too long, bad token ids, no chat template)."""
        out: list[tuple[HeldJob, Rejected]] = []
        for refused in rejected:
            found = self.table.by_engine_id(refused.engine_id)
            if found is None:
                continue
            held = found[0]
            self.table.engine_done(held, refused.engine_id)
            if held.state.writes:
                held.state = JobState.LOST  # no more writes: the failure is written instead
                self.engine.abort(sorted(held.engine_ids))  # its other completions, if any
                out.append((held, refused))
        return out

    async def _write(self, writes: list[JobWrite], retry: bool = True) -> None:
        """One STEP_LUA call (one per shard on a cluster); retried as a whole while Redis is
        unreachable (Redis may have run it: STEP_LUA does not write an event twice, and the
        record and XACK are idempotent), on a cluster only the shards whose call failed, after
        the writes of the last RESEND_WINDOW_S (`_resent`).
        Meanwhile the engine goes on with the jobs it holds (it takes no new ones: intake
        cannot read), so what waits here is bounded by their remaining tokens."""
        if not writes:
            return
        async with self._writing:
            lost: set[str] = set()
            unsent = writes
            resent = False
            while True:
                try:
                    lost |= await self.scripts.publish(unsent)
                    break
                except PartlyPublished as part:  # (a cluster: the shards that answered are done)
                    lost |= part.lost
                    unsent = part.unsent
                    if not retry or not isinstance(part.error, REDIS_ERRORS):
                        raise part.error from None
                    self.outage.failed(part.error)
                except REDIS_ERRORS as exc:
                    if not retry:
                        raise
                    self.outage.failed(exc)
                if not resent:
                    unsent, resent = self._resent() + [replace(w, again=True) for w in unsent], True
                await asyncio.sleep(RETRY_DELAY_S)
            self._remember(writes)
            # (an entry of a write made again is lost where a later write, in the window,
            # acknowledged it: the job has ended; only this call's writes count)
            lost &= {write.entry_id for write in writes}
        self.outage.answered()
        now = time.time()
        holders = await self._holders(lost)
        for write in writes:
            held = self.table.get(write.job_id)
            if held is None:
                continue
            if write.entry_id in lost:
                self.drop(held, JobState.LOST, holders.get(write.entry_id))
            elif write.record is not None:
                self.metrics.finished(held, now)
                self.table.remove(held)

    def _remember(self, writes: list[JobWrite]) -> None:
        now = time.monotonic()
        self._answered.append((now, writes))
        while self._answered[0][0] < now - RESEND_WINDOW_S:
            self._answered.popleft()

    def _resent(self) -> list[JobWrite]:
        """The writes Redis answered in the last RESEND_WINDOW_S, to make again once it answers
        after an outage: where Redis kept them, nothing is written twice (STEP_LUA skips each
        event whose seq the job's stream holds already; the record and the XACK are idempotent;
        a job they ended is reported lost, and is gone from the table); where it lost them,
        they fill the hole. A tenant's token count is left out: a tenant is not limited twice
        for a token."""
        since = time.monotonic() - RESEND_WINDOW_S
        again = [replace(w, tenant_tokens=None, again=True) for at, batch in self._answered if at >= since for w in batch]
        self._answered.clear()
        return again

    async def _holders(self, lost: set[str]) -> dict[str, str]:
        """Who holds the lost entries now (for the log; best effort)."""
        if not lost:
            return {}
        try:
            return await self.scripts.holders(sorted(lost))
        except REDIS_AWAY:
            return {}

    def drop(self, held: HeldJob, state: JobState, holder: str | None = None) -> None:
        """Stop writing for a job (lost to another worker, or released) and abort it here."""
        if state == JobState.LOST and held.state.writes:
            logger.warning("job %s: entry %s is no longer this worker's; held by %s", held.id, held.entry_id,
                           holder or "another worker")
        held.state = state
        if state == JobState.LOST:  # (a released job's held tokens are sent: publish_held)
            held.unsent.clear()
            self._holding.pop(held.id, None)
        if held.engine_ids:
            self.engine.abort(sorted(held.engine_ids))
        else:
            self.table.remove(held)


def _wire_logprobs(logprobs: list[Any] | None) -> list[dict[str, Any]] | None:
    """Engine TokenLogprobs -> the wire form (protocol.Event.logprobs), tokens spelled out."""
    if logprobs is None:
        return None
    return [{} if lp is None else {
        "logprob": lp.logprob, "rank": lp.rank, "top_logprobs": lp.top_logprobs,
        "token": lp.decoded.get(lp.token_id), "decoded": lp.decoded,
    } for lp in logprobs]
