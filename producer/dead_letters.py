"""Dead letters, for operators: list them, and send their jobs back to the queue once what
killed them is fixed (`genq dead ls`, `genq dead retry`).

A job goes to the dead stream when no worker can run its entry: every worker that took it
died (the delivery limit), its payload does not decode, or no live worker serves its model.
The first and last are often fixed by a deploy; retrying then runs the job again from the
start, under its own id, on the queue of its model, with a fresh delivery count.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from producer.jobs import submit_call
from producer.protocol import DEFAULT_PREFIX, ProtocolError, decode_job
from producer.records import as_text, decode_dead_letter

if TYPE_CHECKING:
    from producer.client import Client

# Retry one dead letter. KEYS[1]: job(id), [2]: the requests stream of its model's queue,
# [3]: dead, [4]: events(id). ARGV[1]: the dead letter's id, then SUBMIT_LUA's arguments
# (group, lane suffix, number k of entry arguments, the entry, the queued record).
# Only a job that failed (or whose record expired) is sent again: a dead letter whose job is
# alive or ended well (a duplicate entry of it) stays. The old record and events go, so
# readers see the job queued anew rather than failed. Returns {outcome, detail}: {'queued',
# new entry id} | {'gone', false} (retried or trimmed already) | {'alive', job status}.
RETRY_LUA = """
if #redis.call('XRANGE', KEYS[3], ARGV[1], ARGV[1]) == 0 then return {'gone', false} end
local status = redis.call('HGET', KEYS[1], 'status')
if status and status ~= 'failed' then return {'alive', status} end
redis.call('DEL', KEYS[1], KEYS[4])
redis.pcall('XGROUP', 'CREATE', KEYS[2], ARGV[2], '0', 'MKSTREAM')
local k = tonumber(ARGV[4])
local ref = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 5, 4 + k)) .. ARGV[3]
redis.call('HSET', KEYS[1], 'entry_id', ref, unpack(ARGV, 5 + k))
redis.call('XDEL', KEYS[3], ARGV[1])
return {'queued', ref}
"""


@dataclass(frozen=True)
class DeadLetter:
    dead_id: str  # the entry's id in the dead stream (its time is when it died)
    entry_id: str  # the entry it replaces in the requests stream
    job_id: str | None  # None: the entry named no readable job id
    reason: str
    fields: dict[str, bytes]  # the original entry's fields

    @property
    def died_at(self) -> float:
        return int(self.dead_id.split("-")[0]) / 1000


def list_dead(client: Client, count: int = 100) -> list[DeadLetter]:
    """The oldest `count` dead letters (over every shard's dead stream); ones that do not
    decode are listed with the reason."""
    found = [e for k in client.keys.every_shard for e in cast(list[Any], client.redis.xrange(k.dead, count=count))]
    found.sort(key=lambda e: tuple(int(part) for part in as_text(e[0]).split("-")))
    letters = []
    for dead_id, fields in found[:count]:
        try:
            letter = decode_dead_letter(fields)
        except ProtocolError as exc:
            letters.append(DeadLetter(as_text(dead_id), "?", None, f"unreadable dead letter: {exc}", {}))
            continue
        entry = {as_text(k): v for k, v in letter["entry"].items()} if isinstance(letter["entry"], dict) else {}
        letters.append(DeadLetter(as_text(dead_id), letter["entry_id"], letter["id"], letter["reason"], entry))
    return letters


def retry_dead(client: Client, letter: DeadLetter) -> str:
    """Send a dead letter's job back to its model's queue; returns what happened, in words:
    `queued as <entry id>`, or why it was left (gone already, job alive, undecodable)."""
    try:
        job = decode_job({k.encode(): v for k, v in letter.fields.items()})
    except ProtocolError as exc:
        return f"left: the entry does not decode ({exc})"
    keys, args = submit_call(client.keys_for(job.model), job)
    script = client.redis.register_script(RETRY_LUA)
    outcome, detail = cast(list[Any], script(keys=[*keys, client.keys.for_job(job.id).dead, client.keys.events(job.id)],
                                             args=[letter.dead_id, *args]))
    outcome = as_text(outcome)
    if outcome == "queued":
        return f"queued as {as_text(detail)} on {keys[1]}"
    if outcome == "alive":
        return f"left: job {job.id} is {as_text(detail)} (this was a duplicate entry of it)"
    return "left: it is no longer in the dead stream (retried or trimmed)"


# -- genq dead ------------------------------------------------------------------------------


def build(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="Redis key prefix (default: %(default)s)")
    sub = parser.add_subparsers(dest="action", required=True)
    ls = sub.add_parser("ls", help="the oldest dead letters: id, job, when, why")
    ls.add_argument("--count", type=int, default=100)
    retry = sub.add_parser("retry", help="send dead letters' jobs back to their model's queue")
    retry.add_argument("dead_ids", nargs="*", metavar="DEAD_ID", help="ids as `genq dead ls` prints them")
    retry.add_argument("--all", action="store_true", help="every dead letter")
    return run


def run(args: argparse.Namespace) -> int:
    from producer.client import Client

    with Client(args.redis_url, args.prefix) as client:
        if args.action == "ls":
            for letter in list_dead(client, args.count):
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(letter.died_at))
                print(f"{letter.dead_id}\t{letter.job_id or '-'}\t{when}Z\t{letter.reason}")
            return 0
        if not args.dead_ids and not args.all:
            print("genq dead retry: name DEAD_IDs or pass --all", file=sys.stderr)
            return 2
        letters = {letter.dead_id: letter for letter in list_dead(client, count=10**9)}
        wanted = list(letters) if args.all else args.dead_ids
        missing = [i for i in wanted if i not in letters]
        for dead_id in wanted:
            outcome = retry_dead(client, letters[dead_id]) if dead_id in letters else "left: no such dead letter"
            print(f"{dead_id}\t{outcome}")
    return 1 if missing else 0
