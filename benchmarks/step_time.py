"""Step-time-aware chunking (`--max-step-ms`) against the static token budget, on W2-like
streaming load through the whole stack with long prompts mixed in (their prefill is what
stretches the others' inter-token gaps). One Redis and one `genq api`; for each setting a
fresh `genq worker` with that `--max-step-ms` (0: off), then `genq bench serve` with the same
seeded prompts and arrivals. Prints each setting's ITL p50 and p99 (and their ratio), TTFT p50
and output tokens/s, measured in the same run:

    python benchmarks/step_time.py [--settings 0,200] [--num-prompts 32] [--request-rate 4]
        [--long-fraction 0.15] [--long-input-words 1500] [--output-len 64] [--model-dir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from worker_procs import running_api, running_workers

from producer.redis_server import RedisServer
from worker.benchmarks.serve import add_serve_args, format_report, run_serve_report

PREFIX = "genq-step-time:"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="0,200", help="comma-separated --max-step-ms values (0: off); repeat "
                   "them (0,200,0,200) to see the machine's drift between runs")
    p.add_argument("--worker-args", default="", help="more `genq worker` flags, space-separated")
    p.add_argument("--model-dir", default=None, help="the worker's model (default: SmolLM2-135M-Instruct)")
    add_serve_args(p)
    p.set_defaults(num_prompts=32, request_rate=4.0, long_fraction=0.15, long_input_words=1500)
    args = p.parse_args()
    reports: list[tuple[str, dict]] = []
    with RedisServer() as server, running_api(server.url, PREFIX) as base_url:
        args.base_url = base_url
        for i, setting in enumerate(args.settings.split(",")):
            worker_args = ["--dtype", "bfloat16", "--max-step-ms", setting, *args.worker_args.split()]
            if args.model_dir:
                worker_args += ["--model", args.model_dir]
            with running_workers(server.url, PREFIX, [f"w{i}"], worker_args):
                report = run_serve_report(args)
            reports.append((setting, report))
            print(f"--max-step-ms {setting}\n{format_report(report)}", flush=True)
    print(_table(reports))
    if args.json:
        Path(args.json).write_text(json.dumps([{"max_step_ms": s, **r} for s, r in reports], indent=2))
    return 0


def _table(reports: list[tuple[str, dict]]) -> str:
    lines = [f"{'max_step_ms':>11} {'ITL p50':>9} {'ITL p99':>9} {'p99/p50':>8} {'TTFT p50':>9} {'out tok/s':>10} "
             f"{'failed':>6}"]
    for setting, r in reports:
        itl, ttft = r["itl_s"], r["ttft_s"]
        ratio = itl["p99"] / itl["p50"] if itl["p50"] else float("nan")
        lines.append(f"{setting:>11} {itl['p50'] * 1000:>7.1f}ms {itl['p99'] * 1000:>7.1f}ms {ratio:>7.2f}x "
                     f"{ttft['p50'] * 1000:>7.0f}ms {r['output_tokens_per_s']:>10.1f} {r['failed']:>6}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
