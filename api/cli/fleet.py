"""`genq weights`, `genq sleep`, `genq wake`, `genq pause` and `genq resume`: weights updates,
sleep mode and pausing from a shell, for a trainer's script or an operator without the API's
development endpoints (api.weights_updates, api.sleep_mode and api.pause: the same records, the
same wait for every serving worker of the model).

    genq weights PATH [--model M] [--mode wait|keep]   # every worker serves the checkpoint at PATH
    genq sleep [--level 1|2] [--model M]               # every worker takes no jobs and sleeps
    genq wake [--tags weights,kv_cache] [--model M]    # and wakes
    genq pause [--mode abort|wait|keep] [--model M]    # every worker takes no jobs
    genq resume [--model M]                            # and takes them again
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Coroutine
from typing import Any

from api import pause, sleep_mode, weights_updates
from api.cluster import Cluster
from api.errors import APIError
from producer.async_client import AsyncClient
from producer.cli import printed
from producer.protocol import DEFAULT_PREFIX
from producer.records import PAUSE_MODES, SLEEP_TAGS, WEIGHTS_MODES

Work = Callable[[AsyncClient, Cluster], Coroutine[Any, Any, str]]


def build_weights(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    _common(parser)
    parser.add_argument("path", help="the checkpoint's directory (or GGUF file), as the workers see it")
    parser.add_argument("--mode", default="wait", choices=WEIGHTS_MODES,
                        help="wait: running jobs end on the weights they began with; keep: update between steps")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the workers")
    return lambda args: _run("weights", args, lambda client, cluster: _weights(client, cluster, args))


def build_sleep(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    _common(parser)
    parser.add_argument("--level", type=int, default=1, choices=(1, 2),
                        help="1: give the KV cache's memory back; 2: the weights' too")
    return lambda args: _run("sleep", args, functools.partial(_sleep, model=args.model, level=args.level))


def build_wake(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    _common(parser)
    parser.add_argument("--tags", default=",".join(SLEEP_TAGS), help="what to wake: weights, kv_cache or both")
    return lambda args: _run("wake", args, functools.partial(_sleep, model=args.model, level=0, tags=args.tags))


def build_pause(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    _common(parser)
    parser.add_argument("--mode", default="abort", choices=PAUSE_MODES,
                        help="the running jobs: abort them now (the default, as vLLM's), wait for them to end, "
                             "or keep them frozen until the resume")
    return lambda args: _run("pause", args, functools.partial(_pause, model=args.model, mode=args.mode))


def build_resume(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    _common(parser)
    return lambda args: _run("resume", args, functools.partial(_pause, model=args.model, mode=None))


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="Redis key prefix (default: %(default)s)")
    parser.add_argument("--model", help="the served model (default: the only one served)")


def _run(command: str, args: argparse.Namespace, work: Work) -> int:
    async def go() -> str:
        client = AsyncClient(args.redis_url, args.prefix)
        try:
            return await work(client, Cluster(client.redis, client.keys))
        finally:
            await client.aclose()

    return printed(command, go(), APIError)


async def _weights(client: AsyncClient, cluster: Cluster, args: argparse.Namespace) -> str:
    answer = await weights_updates.update(client, cluster, args.path, args.model, args.mode, args.timeout)
    return str(answer["message"])


async def _sleep(client: AsyncClient, cluster: Cluster, model: str | None, level: int, tags: str = "") -> str:
    wanted = tuple(t for t in tags.split(",") if t) or SLEEP_TAGS
    if unknown := sorted(set(wanted) - set(SLEEP_TAGS)):
        raise APIError(400, f"--tags are {', '.join(SLEEP_TAGS)}, got {', '.join(unknown)}")
    name = await sleep_mode.command(client, cluster, model, level, wanted)
    return f"Model {name}: its workers sleep (level {level})." if level else \
        f"Model {name}: its workers woke {' and '.join(wanted)}."


async def _pause(client: AsyncClient, cluster: Cluster, model: str | None, mode: str | None) -> str:
    name = await pause.command(client, cluster, model, mode)
    return f"Model {name}: its workers are paused (mode {mode})." if mode else f"Model {name}: its workers resumed."
