"""`genq drain NAME ...`: ask live workers to drain and stop, as SIGTERM would, from anywhere
that reaches Redis (a GPU host's shell is not needed): intake stops, jobs that produced
nothing yet go back to the stream at once, the others get the worker's shutdown grace, and
the worker exits 0. The command waits for each worker's heartbeat hash to go.

The request is `drain(name)` holding the worker's `host:pid`, read from its heartbeat: the
worker takes it at its next beat, and a request left for a process that is gone is dropped
by its successor of the same name rather than stopping it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from producer.protocol import DEFAULT_PREFIX, Keys, as_text
from producer.redis_conn import connect, is_cluster_url

REQUEST_TTL_S = 600  # a request no worker took (it died first) is gone after this
POLL_S = 0.2


def build(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("names", nargs="+", metavar="NAME", help="worker names (genq status lists them)")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="Redis key prefix (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for the workers to stop (default: %(default)s)")
    parser.add_argument("--no-wait", action="store_true", help="ask, and return at once")
    return run


def run(args: argparse.Namespace) -> int:
    conn, keys = connect(args.redis_url), Keys(args.prefix, cluster=is_cluster_url(args.redis_url))
    try:
        for name in args.names:
            host, pid = conn.hmget(keys.worker(name), ["host", "pid"])  # type: ignore[misc]
            if host is None or pid is None:
                print(f"genq drain: no live worker named {name!r}", flush=True)
                return 1
            conn.set(keys.drain(name), f"{as_text(host)}:{as_text(pid)}", ex=REQUEST_TTL_S)
            print(f"asked worker {name} (host {as_text(host)}, pid {as_text(pid)}) to drain", flush=True)
        if args.no_wait:
            return 0
        deadline = time.monotonic() + args.timeout
        waiting = list(args.names)
        while waiting:
            for name in [n for n in waiting if not conn.exists(keys.worker(n))]:
                print(f"worker {name} stopped", flush=True)
                waiting.remove(name)
            if waiting and time.monotonic() > deadline:
                print(f"genq drain: still running after {args.timeout:.0f} s: {', '.join(waiting)}", flush=True)
                return 1
            time.sleep(POLL_S)  # polling a condition, bounded by the deadline
        return 0
    finally:
        conn.close()
