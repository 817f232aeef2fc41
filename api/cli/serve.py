"""`genq api [--host 127.0.0.1] [--port 8000]`: serve the app with uvicorn.

Settings come from the environment (GENQ_API_KEYS, GENQ_MAX_QUEUED_JOBS, ...); the flags
below override them.
"""

from __future__ import annotations

import argparse

from producer.cli import Runner


def build(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument("--host", default="127.0.0.1", help="address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument("--prefix", help="Redis key prefix (default: $GENQ_PREFIX or genq:)")
    parser.add_argument(
        "--max-queued-jobs", type=int,
        help="answer 429 at this queue depth (default: $GENQ_MAX_QUEUED_JOBS or 1000)",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn's (default: %(default)s)")
    return run


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from api.main import create_app
    from api.settings import Settings

    overrides = {"redis_url": args.redis_url, "prefix": args.prefix,
                 "max_queued_jobs": args.max_queued_jobs}
    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level)
    return 0
