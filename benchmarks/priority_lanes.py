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

    python benchmarks/priority_lanes.py --steady-s 20 [--lane-aging-s 2]

Lane aging instead: the high lane is kept full (twice max_num_seqs jobs queued at all times)
for `--steady-s` seconds while 16 low-lane jobs wait. In `strict` the worker runs with
`--lane-aging-s 0`, in `aged` with `--lane-aging-s` (and the default one in ten). Prints, per
mode, the low jobs that ended within the window and the high jobs that did.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from worker_procs import running_workers

from producer.client import Client
from producer.protocol import JobStatus
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
    ap.add_argument("--steady-s", type=float, default=0.0, help="run the aging scenario for this long instead")
    ap.add_argument("--lane-aging-s", type=float, default=2.0, help="the aged mode's aging")
    args = ap.parse_args()
    if args.steady_s > 0:
        return _aging(args)
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


def _aging(args: argparse.Namespace) -> int:
    rows = {}
    with RedisServer() as server:
        for mode, aging_s in (("strict", 0.0), ("aged", args.lane_aging_s)):
            worker_args = ["--dtype", args.dtype, "--num-threads", "1", "--max-num-seqs", str(args.max_num_seqs),
                           "--lane-aging-s", str(aging_s)]
            with running_workers(server.url, f"bench-{mode}:", ["bench-aging"], worker_args):
                rows[mode] = _steady(server.url, f"bench-{mode}:", args)
            low, high = rows[mode]
            print(f"{mode:>6}: in {args.steady_s:.0f} s of a full high lane, {low} of 16 low jobs "
                  f"and {high} high jobs ended", flush=True)
    strict_high, aged_high = rows["strict"][1], rows["aged"][1]
    print(f"aged / strict: high jobs ended {aged_high / max(strict_high, 1):.2f}x; "
          f"low jobs ended {rows['aged'][0]} vs {rows['strict'][0]}")
    return 0


def _steady(url: str, prefix: str, args: argparse.Namespace) -> tuple[int, int]:
    """(low jobs ended, high jobs ended) while the high lane stays full for args.steady_s."""
    params = SamplingParams(temperature=0.0, max_tokens=args.interactive_tokens, ignore_eos=True)
    with Client(url, prefix=prefix) as client:
        client.submit("Warm up.", SamplingParams(temperature=0.0, max_tokens=2)).result(600)
        high: list = []
        low: list = []
        end = time.perf_counter() + args.steady_s
        while time.perf_counter() < end:
            queued = [h for h in high if h.status() == JobStatus.QUEUED]
            high += [client.submit(f"Interactive question {len(high) + i}.", params, priority=-1)
                     for i in range(2 * args.max_num_seqs - len(queued))]
            if not low:  # after the high lane is full: the worker is busy with it
                low = [client.submit(f"Background document {i}: summarize it.", params, priority=100)
                       for i in range(16)]
            time.sleep(0.1)  # the load's pace, not a wait for a condition
        ended = [sum(h.status() == JobStatus.FINISHED for h in jobs) for jobs in (low, high)]
        for handle in [*low, *high]:
            handle.cancel()
    return ended[0], ended[1]


if __name__ == "__main__":
    sys.exit(main())
