"""Priority lanes against one first-come-first-served stream: how long a tier's requests wait
behind a backlog.

Each mode starts its own `genq worker` (default model, one CPU thread) on an embedded Redis
under its own prefix, queues a backlog of B background jobs (a batch's lines), then submits
I interactive jobs while it runs, one every `--every-s` seconds. In `fifo` the
interactive jobs have priority 0, as the backlog: they wait behind it, as every job did
before lanes. In `lanes` they have priority -1 (a `genq keys --priority` tier) and the
backlog +100 (what /v1/batches gives its lines): workers take the high lane first.

    python benchmarks/priority_lanes.py [--backlog 48] [--interactive 8] [--every-s 0.5] [--max-num-seqs 8]

Prints, per mode, the interactive jobs' mean and p90 latency (submit to result) and the time
until the whole backlog ended; then the ratios, lanes over fifo.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from worker_procs import running_workers

from producer.client import Client
from producer.redis_server import RedisServer
from producer.sampling_params import SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backlog", type=int, default=48)
    ap.add_argument("--interactive", type=int, default=8)
    ap.add_argument("--backlog-tokens", type=int, default=48, help="max_tokens of each backlog job")
    ap.add_argument("--interactive-tokens", type=int, default=16)
    ap.add_argument("--every-s", type=float, default=0.5, help="an interactive job arrives this often")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    rows = {}
    with RedisServer() as server:
        for mode, (interactive, background) in (("fifo", (0, 0)), ("lanes", (-1, 100))):
            worker_args = ["--dtype", args.dtype, "--num-threads", "1", "--max-num-seqs", str(args.max_num_seqs)]
            with running_workers(server.url, f"bench-{mode}:", ["bench-lanes"], worker_args):
                rows[mode] = _run(server.url, f"bench-{mode}:", args, interactive, background)
            row = rows[mode]
            print(f"{mode:>5}: interactive latency mean {row['mean_s']:.2f} s p90 {row['p90_s']:.2f} s, "
                  f"backlog done after {row['backlog_s']:.1f} s", flush=True)
    fifo, lanes = rows["fifo"], rows["lanes"]
    print(f"lanes / fifo: interactive mean latency {lanes['mean_s'] / fifo['mean_s']:.2f}x, p90 "
          f"{lanes['p90_s'] / fifo['p90_s']:.2f}x, backlog time {lanes['backlog_s'] / fifo['backlog_s']:.2f}x")
    return 0


def _run(url: str, prefix: str, args: argparse.Namespace, interactive: int, background: int) -> dict:
    long = SamplingParams(temperature=0.0, max_tokens=args.backlog_tokens, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=args.interactive_tokens, ignore_eos=True)

    def ask(i: int) -> float:
        time.sleep(max(0.0, start + i * args.every_s - time.perf_counter()))  # its arrival time
        with Client(url, prefix=prefix) as own:
            submitted = time.perf_counter()
            result = own.submit(f"Interactive question {i}: what is {i} plus {i}?", short,
                                priority=interactive).result(600)
        if result.error:
            raise RuntimeError(f"interactive job {i} failed: {result.error}")
        return time.perf_counter() - submitted

    with Client(url, prefix=prefix) as client:
        client.submit("Warm up.", SamplingParams(temperature=0.0, max_tokens=2)).result(600)
        start = time.perf_counter()
        backlog = [client.submit(f"Background document {i}: summarize it.", long, priority=background)
                   for i in range(args.backlog)]
        with ThreadPoolExecutor(args.interactive) as pool:
            latencies = sorted(pool.map(ask, range(args.interactive)))
        for handle in backlog:
            handle.result(600)
        backlog_s = time.perf_counter() - start
    return {"mean_s": statistics.fmean(latencies), "p90_s": latencies[int(0.9 * (len(latencies) - 1))],
            "backlog_s": backlog_s}


if __name__ == "__main__":
    sys.exit(main())
