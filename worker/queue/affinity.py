"""Prefix-cache affinity: a job whose prompt starts as an earlier job's did goes to the worker
that ran that one, while that worker has room, so its prefix cache serves the shared start
(a conversation's next turn, a long system prompt, a shared few-shot header).

Each job has an affinity key: OpenAI's `prompt_cache_key` when the request gives one, else a
digest of its prompt's start (a chat's messages up to the first user message and its tools,
a text's first HEAD_CHARS characters, a token prompt's first HEAD_TOKENS ids), its model and
its cache salt. The worker that starts a job records its own name under the key
(`affinity(digest)`, expiring cache_affinity_ttl_s later). A worker that reads a job whose key
names another live, serving worker of the same stream hands the entry to it while that
worker has room (fewer entries pending under its name than its max_num_seqs, and at most
BALANCE_SLACK more than under the reader's, read then):
HANDOFF_LUA claims the entry in the owner's name and tells the owner its id on the owner's
handoff channel, and the owner admits it as if it had read it. A worker with no free slot
named gets nothing handed: the reader runs the job, and becomes the key's owner.

The entry never leaves the stream and the job's record stays `queued` until the owner starts
it, so nothing is lost when the owner dies or misses the notice: the entry sits idle in its
pending list and is reclaimed like any of a dead worker's.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import redis

from producer.protocol import Job, pack
from producer.redis_conn import mget
from worker.queue.config import WorkerConfig
from worker.queue.scripts import Scripts

logger = logging.getLogger(__name__)

HEAD_CHARS = 256  # a text prompt's start that names what it shares with others
HEAD_TOKENS = 64  # a token prompt's
# how many more jobs than the reader holds a worker may hold and still be handed one: the
# queueing a prefix-cache hit is worth
BALANCE_SLACK = 4


def affinity_digest(job: Job) -> str | None:
    """The key of the prompt start `job` shares with others; None where no prefix cache is
    served (embeddings, a prompt given as its input states)."""
    if job.pooling_params is not None:
        return None
    head: Any
    if job.prompt_cache_key is not None:
        head = ["key", job.prompt_cache_key]
    elif job.messages is not None:
        head = ["chat", _opening(job.messages), job.tools]  # (templates put the tools up front)
    elif job.prompt is not None:
        head = ["text", job.prompt[:HEAD_CHARS]]
    elif job.prompt_token_ids is not None:
        head = ["ids", job.prompt_token_ids[:HEAD_TOKENS]]
    else:
        return None
    return hashlib.blake2b(pack([job.model, job.cache_salt, head]), digest_size=16).hexdigest()


def _opening(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages up to the first user message: what every turn of one conversation shares."""
    for i, message in enumerate(messages):
        if message.get("role") == "user":
            return messages[: i + 1]
    return messages


class Affinity:
    """This worker's side of affinity: handing jobs to their keys' owners, owning the keys of
    the jobs it starts."""

    def __init__(self, config: WorkerConfig, scripts: Scripts) -> None:
        self.enabled = config.cache_affinity
        self.ttl_ms = int(config.cache_affinity_ttl_s * 1000)
        self.scripts = scripts
        self.name = config.name
        self.queue = config.queue

    async def hand_off(self, jobs: Sequence[tuple[str, Job]]) -> set[str]:
        """Hand (entry id, job) pairs to their keys' owners where those have room; returns
        the entry ids handed over. A Redis refusal (the stream or group gone mid-way) hands
        nothing: affinity only ever chooses where a job runs."""
        if not self.enabled:
            return set()
        try:
            return await self._hand_off(jobs)
        except redis.ResponseError as exc:
            logger.warning("handing jobs to their prefix caches' workers failed (%s); running them here", exc)
            return set()

    async def _hand_off(self, jobs: Sequence[tuple[str, Job]]) -> set[str]:
        digests = {entry_id: d for entry_id, job in jobs if (d := affinity_digest(job)) is not None}
        if not digests:
            return set()
        conn, keys = self.scripts.conn, self.scripts.keys
        owned = dict(zip(digests, await mget(conn, [keys.affinity(d) for d in digests.values()]), strict=True))
        owners = {entry_id: o.decode() for entry_id, o in owned.items() if o is not None and o.decode() != self.name}
        rooms = await self._rooms(sorted(set(owners.values())))
        plan: dict[str, list[str]] = {}
        for entry_id, owner in owners.items():
            if rooms.get(owner, 0) > 0:
                rooms[owner] -= 1
                plan.setdefault(owner, []).append(entry_id)
        handed: set[str] = set()
        for owner, entry_ids in plan.items():
            moved = await self.scripts.hand_off(owner, entry_ids)
            handed.update(moved)
            logger.info("handed %d entries to worker %s, whose prefix cache holds their start: %s",
                        len(moved), owner, moved)
        return handed

    async def _rooms(self, workers: list[str]) -> dict[str, int]:
        """The jobs each worker could still be handed, from the entries pending under each
        name now in every lane (what it runs, waits on, or was handed and has not yet taken): below its
        max_num_seqs, and no more than BALANCE_SLACK above this worker's own (a prompt start
        many jobs share, such as a common header, must not pile them all on one worker while
        this one idles); none for a worker gone, draining, asleep, paused or on another stream."""
        if not workers:
            return {}
        pipe = self.scripts.conn.pipeline(transaction=False)
        for worker in workers:
            pipe.hmget(self.scripts.keys.worker(worker), ["state", "queue", "max_num_seqs", "sleep_level", "paused"])
        for stream in (s for keys in self.scripts.keys.every_shard for s in keys.lane_streams):
            pipe.xpending(stream, self.scripts.keys.group)
        replies = await pipe.execute()
        infos, summaries = replies[:len(workers)], replies[len(workers):]
        pending: dict[str, int] = {}
        for summary in summaries:
            for c in summary.get("consumers") or []:
                pending[_text(c["name"])] = pending.get(_text(c["name"]), 0) + int(c["pending"])
        rooms = {}
        mine = pending.get(self.name, 0)
        for worker, (state, queue, max_num_seqs, sleep_level, paused) in zip(workers, infos, strict=True):
            takes_jobs = sleep_level in (None, b"0") and paused in (None, b"0")
            if state == b"serving" and takes_jobs and _text(queue or b"") == self.queue and max_num_seqs is not None:
                theirs = pending.get(worker, 0)
                rooms[worker] = min(int(max_num_seqs) - theirs, mine + BALANCE_SLACK - theirs)
        return rooms

    async def own(self, jobs: Sequence[Job]) -> None:
        """Name this worker the owner of the keys of jobs it starts."""
        if not self.enabled:
            return
        digests = {d for job in jobs if (d := affinity_digest(job)) is not None}
        if not digests:
            return
        pipe = self.scripts.conn.pipeline(transaction=False)
        for digest in sorted(digests):
            pipe.set(self.scripts.keys.affinity(digest), self.name, px=self.ttl_ms)
        await pipe.execute()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
