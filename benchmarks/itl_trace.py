"""Find the ITL tail: W2 (streaming completions, prompts and outputs U[32,128] words / tokens,
Poisson arrivals) through the whole stack (Redis, `genq api`, one `genq worker`) with the
per-step trace on (GENQ_TRACE_DIR), then each client-side inter-token gap above 2x the ITL p50
attributed to its cause (worker/benchmarks/itl_trace.py: a long step, the engine between steps,
the publish, the relay, the client, a gc pause). Prints ITL p50/p99, the share of tail gaps per
cause, the parts' typical values, and the engine's own offline step time at the run's median
batch size, in a process of its own (the issue's target: ITL p50 at most 1.25x it, ITL p99 at
most 2x ITL p50).

Each `--variant NAME=FLAGS` (more `genq worker` flags; `KEY=VALUE` words set the environment of
both processes instead) runs the same seeded load on a fresh API and worker, one after another,
so a change is measured before and after in one run:

    python benchmarks/itl_trace.py [--num-prompts 64] [--request-rate 4] [--variant base=]
        [--variant 'passive=OMP_WAIT_POLICY=PASSIVE --max-step-ms 200'] [--model-dir DIR] [--keep-trace DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from worker_procs import running_api, running_workers

from producer.redis_server import RedisServer
from worker.benchmarks.itl_trace import CAUSES, attribute, cause_shares, client_gaps, read_trace
from worker.benchmarks.serve import WORDS, percentiles

PREFIX = "genq-itl-trace:"
TAIL_RATIO = 2.0  # a gap above this many times the ITL p50 is in the tail
OFFLINE_DECODE_STEPS = 20  # decode steps the offline engine is timed over


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=4.0)
    p.add_argument("--min-len", type=int, default=32, help="prompt words and output tokens are U[min, max]")
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="a setting to run: more `genq worker` flags and KEY=VALUE environment words (default: base=)")
    p.add_argument("--model-dir", default=None, help="the worker's model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--keep-trace", default=None, help="leave the trace files here (default: a temporary directory)")
    p.add_argument("--json", default=None)
    p.add_argument("--offline-batch", type=int, default=None, help=argparse.SUPPRESS)  # (the offline step's process)
    args = p.parse_args()
    if args.offline_batch is not None:
        print(json.dumps(offline_step_ms(args.offline_batch, args.model_dir)))
        return 0
    variants = [v.partition("=")[::2] for v in args.variant or ["base="]]
    out_dir = Path(args.keep_trace) if args.keep_trace else Path(tempfile.mkdtemp(prefix="genq-itl-trace-"))
    results = []
    with RedisServer() as server:
        for i, (name, flags) in enumerate(variants):
            trace_dir = out_dir / f"{i}-{name}"
            requests, elapsed = _run_stack(server.url, f"{PREFIX}{i}:", trace_dir, flags.split(), args)
            result = _analyse(name, requests, elapsed, trace_dir)
            result["offline_step_ms"] = _offline(round(result["median_decodes"]), flags.split(), args)
            results.append(result)
            print(_format(result), flush=True)
    print(_table(results))
    print(f"trace files: {out_dir}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _split(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """A variant's KEY=VALUE environment words, and its flags."""
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    return env, [w for w in words if not ("=" in w and not w.startswith("-"))]


def _offline(batch: int, words: list[str], args: argparse.Namespace) -> float:
    """The offline step time at `batch`, in a process of its own with the variant's environment
    (OMP_WAIT_POLICY, say, is read as torch loads; PASSIVE unless set, as a worker has it)."""
    cmd = [sys.executable, __file__, "--offline-batch", str(batch)] + (["--model-dir", args.model_dir] if args.model_dir
                                                                      else [])
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, **_split(words)[0]}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def _run_stack(redis_url: str, prefix: str, trace_dir: Path, words: list[str],
               args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    """A fresh API and worker tracing into `trace_dir`, the load through them; the requests seen."""
    variant_env, flags = _split(words)
    env = dict(os.environ, GENQ_TRACE_DIR=str(trace_dir), **variant_env)
    worker_args = ["--dtype", "bfloat16", *flags] + (["--model", args.model_dir] if args.model_dir else [])
    with running_api(redis_url, prefix, env) as base_url, running_workers(redis_url, prefix, ["w"], worker_args, env):
        return asyncio.run(w2_load(base_url, args))


async def w2_load(base_url: str, args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    """W2: each request's job id and the unix times its text chunks arrived; the run's length."""
    rng = random.Random(args.seed)
    shapes = [(rng.randint(args.min_len, args.max_len), rng.randint(args.min_len, args.max_len))
              for _ in range(args.num_prompts)]
    prompts = [(" ".join(rng.choice(WORDS) for _ in range(words)), out) for words, out in shapes]
    limits = httpx.Limits(max_connections=args.num_prompts)
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in prompts:
            tasks.append(asyncio.create_task(_one(http, model, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(args.request_rate))
        requests = await asyncio.gather(*tasks)
        return requests, time.perf_counter() - start


async def _one(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True}
    request: dict[str, Any] = {"job": None, "chunks": [], "error": None, "tokens": max_tokens, "sent": time.time()}
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            request["error"] = f"HTTP {resp.status_code}"
            return request
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                request["error"] = str(chunk["error"])
            elif chunk.get("choices") and chunk["choices"][0].get("text"):
                request["chunks"].append(time.time())
                request["job"] = chunk["id"].removeprefix("cmpl-")
    return request


def _analyse(name: str, requests: list[dict[str, Any]], elapsed: float, trace_dir: Path) -> dict[str, Any]:
    ok = [r for r in requests if r["error"] is None and r["chunks"]]
    itl = percentiles(client_gaps(ok))
    trace = read_trace(trace_dir)
    threshold_s = TAIL_RATIO * (itl["p50"] or 0.0)
    gaps, typical = attribute(ok, trace, threshold_s)
    steps_ms = [s["ms"] for s in trace.steps]
    decodes = [s["decodes"] for s in trace.steps if s["decodes"]]
    return {
        "name": name, "failed": len(requests) - len(ok), "duration_s": round(elapsed, 2),
        "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / elapsed, 1),
        "itl_s": itl, "ttft_s": percentiles([r["chunks"][0] - r["sent"] for r in ok]), "num_gaps": len(client_gaps(ok)), "tail_gaps": len(gaps),
        "shares": cause_shares(gaps),
        "mean_excess_ms": {c: round(statistics.fmean([g.excess_ms[c] for g in gaps if g.cause == c]), 1)
                           for c in CAUSES if any(g.cause == c for g in gaps)},
        "prefill_in_long_steps": sum(1 for g in gaps if g.cause == "long step" and g.step and g.step["prefill_tokens"]),
        "typical_ms": vars(typical),
        "step_ms": percentiles(steps_ms), "median_decodes": statistics.median(decodes) if decodes else 0,
        "gc": _gc_summary([g for g in trace.gcs if g["start"] >= min(r["sent"] for r in requests)]),
    }


def _gc_summary(gcs: list[dict[str, Any]]) -> dict[str, Any]:
    """The collections from the load's first request on (a worker's start makes full passes of
    up to 200 ms over the model it loads, before it freezes those objects and takes a job)."""
    return {"count": len(gcs), "total_ms": round(sum(g["ms"] for g in gcs), 1),
            "max_ms": max((g["ms"] for g in gcs), default=0.0),
            "full": sum(1 for g in gcs if g["generation"] == 2)}


def offline_step_ms(batch: int, model_dir: str | None) -> float:
    """The engine's own decode step time (median ms) at `batch` sequences, in this process."""
    from producer.sampling_params import SamplingParams
    from worker.config import EngineConfig
    from worker.core.engine import Engine

    engine = Engine(EngineConfig(model=model_dir, dtype="bfloat16"))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=OFFLINE_DECODE_STEPS + 40, ignore_eos=True, temperature=0.0)
    for i in range(max(batch, 1)):
        prompt = " ".join(rng.choice(WORDS) for _ in range(80))
        engine.add_request(f"offline-{i}", prompt, params)
    times = []
    while engine.has_unfinished_requests() and len(times) < OFFLINE_DECODE_STEPS:
        start = time.perf_counter()
        engine.step()
        shape = engine.last_step
        if shape.prefill_tokens == 0 and shape.decode_tokens == batch:
            times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 2) if times else float("nan")


def _format(r: dict[str, Any]) -> str:
    itl, typical = r["itl_s"], r["typical_ms"]
    lines = [f"[{r['name']}] {r['failed']} failed, {r['duration_s']} s, {r['output_tokens_per_s']} out tok/s; "
             f"ITL p50 {itl['p50'] * 1000:.1f} ms p99 {itl['p99'] * 1000:.1f} ms; TTFT p50 "
             f"{r['ttft_s']['p50'] * 1000:.0f} ms; "
             f"{r['tail_gaps']} of {r['num_gaps']} gaps above {TAIL_RATIO:g}x p50",
             "  typical: " + ", ".join(f"{k} {v:.1f}" for k, v in typical.items())
             + f"; step p50 {r['step_ms']['p50']:.1f} ms p99 {r['step_ms']['p99']:.1f} ms at a median "
             f"{r['median_decodes']} decodes; gc under load {r['gc']['count']} pauses ({r['gc']['full']} full), "
             f"{r['gc']['total_ms']} ms, longest {r['gc']['max_ms']} ms",
             "  tail gaps by cause: " + ", ".join(f"{c} {s:.0%} (+{r['mean_excess_ms'][c]} ms)"
                                                  for c, s in r["shares"].items() if s)
             + f"; long steps with a prefill chunk: {r['prefill_in_long_steps']}"]
    return "\n".join(lines)


def _table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'variant':<12} {'ITL p50':>9} {'ITL p99':>9} {'p99/p50':>8} {'batch':>6} {'offline':>9} "
             f"{'p50/offline':>11} {'TTFT p50':>9} {'out tok/s':>10} {'failed':>6}"]
    for r in results:
        p50, p99, offline = r["itl_s"]["p50"] * 1000, r["itl_s"]["p99"] * 1000, r["offline_step_ms"]
        lines.append(f"{r['name']:<12} {p50:>7.1f}ms {p99:>7.1f}ms {p99 / p50:>7.2f}x {r['median_decodes']:>6} "
                     f"{offline:>7.1f}ms {p50 / offline:>10.2f}x {r['ttft_s']['p50'] * 1000:>7.0f}ms "
                     f"{r['output_tokens_per_s']:>10.1f} {r['failed']:>6}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
