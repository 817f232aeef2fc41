"""The `genq` command line.

Subcommands live in `SUBCOMMANDS`: a name, a one-line help and the dotted path of a builder
`build(parser) -> run`, where `run(args) -> exit status`. Only the chosen subcommand's module
is imported, so `genq submit` never pays for `import torch`; another package adds its own
command with one entry here, e.g. `"worker": Subcommand("...", "worker.cli:build")`.

The environment is read here and nowhere else: `GENQ_REDIS_URL` is the default of every
subcommand's `--redis-url`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from producer.jobs import DEFAULT_REDIS_URL

Runner = Callable[[argparse.Namespace], int]
SUBMIT_MAX_TOKENS = 64  # genq submit's default: a short answer, not SamplingParams' 16
Builder = Callable[[argparse.ArgumentParser], Runner]


@dataclass(frozen=True)
class Subcommand:
    help: str
    builder: str  # "module:function", imported only when this subcommand runs


SUBCOMMANDS: dict[str, Subcommand] = {
    "redis": Subcommand("run a local Redis server in the foreground", "producer.cli:build_redis"),
    "submit": Subcommand("submit a generation job and print its text", "producer.cli:build_submit"),
    "inspect": Subcommand("print a job's record, payload and events", "producer.cli:build_inspect"),
    "status": Subcommand("each queue's depth, each live worker's load, the dead letters", "api.cli.status:build"),
    "usage": Subcommand("tokens metered by day, API key and model", "api.cli.usage:build"),
    "dead": Subcommand("list dead letters, or send their jobs back to the queue", "producer.dead_letters:build"),
    "drain": Subcommand("ask workers to drain and stop, as SIGTERM would, from anywhere", "producer.drain:build"),
    "worker": Subcommand("run a GPU worker: pull jobs into the engine (as arq worker.WorkerSettings does)", "worker.cli:build"),
    "api": Subcommand("serve the OpenAI-compatible HTTP API", "api.cli.serve:build"),
    "up": Subcommand("run the whole stack: Redis, one worker and the API", "producer.stack:build"),
    "bench": Subcommand("benchmarks: throughput (offline) and serve (HTTP load)", "worker.benchmarks.throughput:build"),
    "lora": Subcommand("add, remove or list LoRA adapters the workers load at run time", "api.cli.lora:build"),
    "keys": Subcommand("create, list or revoke API keys, each with its own limits and models", "api.cli.keys:build"),
    "weights": Subcommand("every worker of a model serves another checkpoint of it, no restart",
                          "api.cli.fleet:build_weights"),
    "sleep": Subcommand("every worker of a model takes no jobs and gives its device's memory back",
                        "api.cli.fleet:build_sleep"),
    "wake": Subcommand("wake the workers of a model that sleep", "api.cli.fleet:build_wake"),
    "pause": Subcommand("every worker of a model takes no jobs; its running ones are aborted, end or wait",
                        "api.cli.fleet:build_pause"),
    "resume": Subcommand("the paused workers of a model take jobs again", "api.cli.fleet:build_resume"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `genq` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        top.parse_args(argv)  # prints help or "invalid choice", exits
        return 2
    name, rest = argv[0], argv[1:]
    # Ctrl-C stops the foreground commands (redis, up, submit) even when our parent started us
    # with SIGINT ignored, as a non-interactive shell does for a background job.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser(prog=f"genq {name}", description=SUBCOMMANDS[name].help)
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("GENQ_REDIS_URL", DEFAULT_REDIS_URL),
        help="Redis to use (default: $GENQ_REDIS_URL or %(default)s)",
    )
    run = _load_builder(SUBCOMMANDS[name].builder)(parser)
    return run(parser.parse_args(rest))


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="genq", description="LLM generation jobs over Redis.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, spec in SUBCOMMANDS.items():
        sub.add_parser(name, help=spec.help, add_help=False)
    return parser


def printed(command: str, work: Coroutine[Any, Any, str], refused: type[Exception] | tuple[type[Exception], ...]) -> int:
    """Run a subcommand's coroutine and print what it returns (exit 0), or, for a `refused`
    exception, `genq COMMAND: why` on stderr (exit 1)."""
    try:
        print(asyncio.run(work))
    except refused as exc:
        print(f"genq {command}: {exc}", file=sys.stderr)
        return 1
    return 0


def _load_builder(path: str) -> Builder:
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


# ---------------------------------------------------------------------------------------------
# genq redis


def build_redis(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument("--port", type=int, help="port (default: the one in --redis-url)")
    parser.add_argument("--dir", help="data directory: its append-only file survives restarts "
                        "(default: $XDG_DATA_HOME/genq/redis-PORT, else ~/.local/share/genq/redis-PORT)")
    parser.add_argument("--ephemeral", action="store_true",
                        help="memory only: a restart forgets every job (--dir is then just its working dir)")
    return run_redis


def run_redis(args: argparse.Namespace) -> int:
    from producer.children import stop_signals_ignored, stop_signals_interrupt
    from producer.redis_server import command_server

    port = args.port if args.port is not None else (urlparse(args.redis_url).port or 6379)
    server = command_server(port, args.dir, args.ephemeral, os.environ.get("XDG_DATA_HOME"))
    # Ctrl-C, SIGTERM or SIGHUP can come at any point, even before the server answers: always stop it
    with stop_signals_interrupt():
        try:
            process = server.start().process
            assert process is not None
            print(f"redis listening on {server.url} (pid {server.pid}), {server.data_note()}; "
                  "Ctrl-C stops it", flush=True)
            status = process.wait()
        except KeyboardInterrupt:
            return 0
        finally:
            with stop_signals_ignored():
                server.stop()
    print(f"genq: redis-server exited with status {status}", file=sys.stderr)
    return 1


# ---------------------------------------------------------------------------------------------
# genq submit


def build_submit(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument("prompt")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    parser.add_argument("--image", action="append", default=[], metavar="FILE",
                        help="an image the user message shows before its text (implies --chat; repeatable)")
    parser.add_argument("--audio", action="append", default=[], metavar="FILE",
                        help="an audio clip (WAV, MP3, FLAC, ...) the user message plays before its text "
                        "(implies --chat; repeatable)")
    parser.add_argument("--embed", action="store_true",
                        help="an embedding job: print the prompt's vector as a JSON list")
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--max-tokens", type=int, help=f"default {SUBMIT_MAX_TOKENS}")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--params", type=_json_object, default={}, metavar="JSON",
        help='any other SamplingParams fields, e.g. \'{"top_k": 40, "stop": ["\\n"]}\'; '
        "the flags above win",
    )
    parser.add_argument("--model")
    parser.add_argument("--job-id")
    parser.add_argument("--priority", type=int, default=0, help="lower runs first")
    parser.add_argument("--timeout", type=float, help="seconds to wait for the result")
    return run_submit


def run_submit(args: argparse.Namespace) -> int:
    """Submit, then print the text (streamed or final). Ctrl-C cancels the job."""
    from producer.client import Client
    from producer.jobs import JobFailed
    from producer.pooling_params import PoolingParams
    from producer.sampling_params import SamplingParams

    try:
        params = SamplingParams.from_dict(_submit_params(args)) if not args.embed else SamplingParams()
        prompt = _submit_prompt(args)
        with Client(args.redis_url) as client:
            handle = client.submit(
                prompt, params, priority=args.priority, job_id=args.job_id, model=args.model,
                pooling_params=PoolingParams() if args.embed else None,
            )
            print(f"job {handle.id}", file=sys.stderr, flush=True)
            if args.embed:
                print(json.dumps(handle.result(args.timeout).embedding))
                return 0
            return _print_job(handle, args.stream, args.timeout)
    except (ValueError, TimeoutError, JobFailed) as exc:
        print(f"genq: {exc}", file=sys.stderr)
        return 1
    except _redis_errors() as exc:
        print(f"genq: cannot reach Redis at {args.redis_url}: {exc}", file=sys.stderr)
        return 1


def _submit_prompt(args: argparse.Namespace) -> Any:
    """The text, or with --chat a user message; with --image or --audio its content parts:
    each file's bytes (a clip read and queued as 16 kHz mono WAV, as the API does), then the
    text. ValueError naming a file that cannot be read."""
    if not (args.chat or args.image or args.audio):
        return args.prompt
    if not (args.image or args.audio):
        return [{"role": "user", "content": args.prompt}]
    from producer.audio import AUDIO_RATE, read_clip, to_wav

    parts: list[dict[str, Any]] = []
    for path in args.image:
        parts.append({"type": "image", "image": _read_file(path)})
    for path in args.audio:
        parts.append({"type": "audio", "audio": to_wav(read_clip(_read_file(path), path, AUDIO_RATE), AUDIO_RATE)})
    return [{"role": "user", "content": [*parts, {"type": "text", "text": args.prompt}]}]


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _submit_params(args: argparse.Namespace) -> dict[str, Any]:
    """--params, overridden by the flags that were given."""
    flags = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
             "seed": args.seed}
    return {"max_tokens": SUBMIT_MAX_TOKENS, **args.params, **{k: v for k, v in flags.items() if v is not None}}


def _print_job(handle: Any, stream: bool, timeout_s: float | None) -> int:
    try:
        if stream:
            for delta in handle.stream(timeout_s):
                print(delta.text, end="", flush=True)
            print()
        else:
            print(handle.result(timeout_s).text)
        return 0
    except KeyboardInterrupt:
        handle.cancel()  # the caller gave up: free the worker's slot
        print(f"\ngenq: cancelled job {handle.id}", file=sys.stderr)
        return 130


def _redis_errors() -> tuple[type[Exception], ...]:
    from producer.redis_conn import REDIS_AWAY  # (redis-py, imported when a command needs it)

    return REDIS_AWAY


# ---------------------------------------------------------------------------------------------
# genq inspect


def build_inspect(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument("job_id")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    return run_inspect


def run_inspect(args: argparse.Namespace) -> int:
    from producer.client import Client

    try:
        with Client(args.redis_url) as client:
            view = client.inspect(args.job_id)
            view["keys"] = _job_names(client.keys, args.job_id, view["record"])
    except _redis_errors() as exc:
        print(f"genq: cannot reach Redis at {args.redis_url}: {exc}", file=sys.stderr)
        return 1
    if view["record"] is None and not view["events"]:
        print(f"genq: no job {args.job_id}", file=sys.stderr)
        return 1
    print(json.dumps(view, indent=2) if args.json else format_inspect(view))
    return 0


def _job_names(keys: Any, job_id: str, record: dict[str, Any] | None) -> dict[str, str | None]:
    """The job's Redis names, for redis-cli -c (on a Redis Cluster they carry its shard's tag)."""
    from producer.jobs import job_names

    entry = (record or {}).get("entry_id")
    at = keys.on_queue((record or {}).get("queue") or "").locate(entry) if entry else None
    return job_names(keys, job_id, at)


def format_inspect(view: dict[str, Any]) -> str:
    """Human-readable job view: record, payload, then one line per event."""
    lines = [f"job {view['id']}" + ("  (cancel requested)" if view["cancel_requested"] else "")]
    lines += _section("keys", view.get("keys"))  # (for redis-cli -c)
    lines += _section("record", view["record"])
    if view["job"] is None and (view["record"] or {}).get("entry_id"):
        lines.append("payload: (gone: workers trim ended jobs' entries from the requests stream)")
    else:
        lines += _section("payload", view["job"])
    lines.append(f"events ({len(view['events'])}):")
    for event in view["events"]:
        lines.append("  " + _event_line(event))
    return "\n".join(lines)


def _section(title: str, data: dict[str, Any] | None) -> list[str]:
    if data is None:
        return [f"{title}: (none)"]
    shown = {k: v for k, v in data.items() if v not in (None, {}, [])}
    return [f"{title}:"] + [f"  {k}: {_short(v)}" for k, v in shown.items()]


def _event_line(event: dict[str, Any]) -> str:
    if "protocol_error" in event:
        return f"undecodable: {event['protocol_error']}"
    line = f"#{event['seq']} [{event['index']}] {event['text']!r} {event['token_ids']}"
    for key in ("finish_reason", "stop_reason", "usage", "error"):
        if event.get(key) is not None:
            line += f" {key}={event[key]}"
    return line


def _short(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


if __name__ == "__main__":
    sys.exit(main())
