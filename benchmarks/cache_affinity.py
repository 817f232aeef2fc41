"""Prefix-cache affinity (worker.queue.affinity) against none, on two workers of one stream.

Each mode starts its own two `genq worker` processes (default model, one CPU thread each) on
an embedded Redis under its own prefix, then runs the same multi-turn workload: C
conversations at once, each of T turns; a turn is the conversation so far (a long opening
document of its own, the replies, the questions) plus a new question, submitted when the
turn before it has ended. With affinity (GENQ_CACHE_AFFINITY_TTL_S=600) a conversation's
turns go to the worker that ran its last one; without (0) to whichever worker reads them.

    python benchmarks/cache_affinity.py [--conversations 8] [--turns 4] [--opening-words 600] [--shared-opening]

Prints, per mode, the share of the later turns' prompt tokens the prefix cache served, their
mean and p90 latency, and the wall time; then the ratios, affinity over none.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import redis
from worker_procs import running_workers

from producer.client import Client
from producer.protocol import Keys
from producer.redis_server import RedisServer
from producer.sampling_params import SamplingParams

WORKERS = ("bench-a", "bench-b")
WORDS = "river stone cloud lamp paper garden window silver market engine letter forest bridge candle".split()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--opening-words", type=int, default=600, help="words in each conversation's opening document")
    ap.add_argument("--shared-opening", action="store_true",
                    help="every conversation opens with the same document (one affinity key for all: the "
                    "load must still spread over both workers)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    rows = {}
    with RedisServer() as server:
        for mode, ttl in (("none", "0"), ("affinity", "600")):
            prefix = f"bench-{mode}:"
            worker_args = ["--dtype", args.dtype, "--num-threads", "1", "--cache-affinity-ttl-s", ttl]
            with running_workers(server.url, prefix, WORKERS, worker_args):
                rows[mode] = _run(server.url, prefix, args)
            print(f"{mode:>8}: cached {rows[mode]['cached']:.1%} of later turns' prompt tokens, latency mean "
                  f"{rows[mode]['mean_s']:.3f} s p90 {rows[mode]['p90_s']:.3f} s, wall {rows[mode]['wall_s']:.1f} s, "
                  f"turns per worker {rows[mode]['per_worker']}", flush=True)
    none, aff = rows["none"], rows["affinity"]
    print(f"affinity / none: cached share {aff['cached'] / max(none['cached'], 1e-9):.2f}x, mean latency "
          f"{aff['mean_s'] / none['mean_s']:.2f}x, p90 latency {aff['p90_s'] / none['p90_s']:.2f}x, "
          f"wall {aff['wall_s'] / none['wall_s']:.2f}x")
    return 0


def _run(url: str, prefix: str, args: argparse.Namespace) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    conn = redis.Redis.from_url(url)
    keys = Keys(prefix)

    def conversation(c: int) -> list[tuple[float, int, int, str]]:
        rng = random.Random(0 if args.shared_opening else c)
        text = "Document: " + " ".join(rng.choice(WORDS) for _ in range(args.opening_words)) + f"\nReader {c}."
        turns = []
        with Client(url, prefix=prefix) as client:
            for t in range(args.turns):
                text += f"\nQuestion {t + 1}: which word comes next?\nAnswer:"
                start = time.perf_counter()
                result = client.submit(text, params).result(600)
                latency = time.perf_counter() - start
                if result.error or result.usage is None:
                    raise RuntimeError(f"conversation {c} turn {t} failed: {result.error}")
                worker = conn.hget(keys.job(result.id), "worker").decode()
                turns.append((latency, result.usage["prompt_tokens"], result.usage.get("cached_tokens", 0), worker))
                text += result.text
        return turns

    start = time.perf_counter()
    with ThreadPoolExecutor(args.conversations) as pool:
        turns = list(pool.map(conversation, range(args.conversations)))
    wall = time.perf_counter() - start
    later = [turn for conv in turns for turn in conv[1:]]
    latencies = sorted(lat for lat, *_ in later)
    per_worker = {w: sum(1 for conv in turns for *_, worker in conv if worker == w) for w in WORKERS}
    conn.close()
    return {
        "cached": sum(c for _, _, c, _ in later) / sum(p for _, p, _, _ in later),
        "mean_s": statistics.fmean(latencies),
        "p90_s": latencies[int(0.9 * (len(latencies) - 1))],
        "wall_s": wall,
        "per_worker": per_worker,
    }


if __name__ == "__main__":
    sys.exit(main())
