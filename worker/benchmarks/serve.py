"""`genq bench serve`: streaming load on a running genq (or any OpenAI-compatible) API.

Arrivals are Poisson at `--request-rate` (`inf` sends everything at once), optionally capped
at `--max-concurrency` requests in flight. Reports time to first token, inter-token latency
and end-to-end latency percentiles, throughput, and failures. Imports no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

WORDS = "the quick brown fox jumps over lazy dog river mountain light cloud stone tree".split()


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_tokens: int = 0
    error: str | None = None


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the API's root URL")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-words", type=int, default=64, help="words per random prompt")
    p.add_argument("--long-fraction", type=float, default=0.0,
                   help="this share of the prompts (seeded) has --long-input-words words: long prompts beside short "
                        "ones, whose prefill the others' decodes wait on")
    p.add_argument("--long-input-words", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request (ignore_eos)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--json", default=None)


def run_serve(args: argparse.Namespace) -> int:
    report = run_serve_report(args)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["failed"] == 0 else 1


def run_serve_report(args: argparse.Namespace) -> dict[str, Any]:
    """One run of the load `args` describe; its report."""
    return asyncio.run(serve_benchmark(args))


async def serve_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompts = make_prompts(rng, args.num_prompts, args.input_words, args.long_fraction, args.long_input_words)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout_s, limits=limits) as http:
        model = args.model or await _first_model(http)
        gate = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(_gated(gate, http, model, prompt, args.output_len)))
            await asyncio.sleep(_next_gap(rng, args.request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return summarize(results, elapsed, args)


def make_prompts(rng: random.Random, num: int, words: int, long_fraction: float = 0.0,
                 long_words: int = 0) -> list[str]:
    """Random prompts of `words` words, each of them `long_words` long with probability `long_fraction`."""
    # (no draw without long prompts: the prompts stay those of earlier runs)
    lengths = [long_words if long_fraction and rng.random() < long_fraction else words for _ in range(num)]
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in lengths]


async def _first_model(http: httpx.AsyncClient) -> str:
    resp = await http.get("/v1/models")
    resp.raise_for_status()
    data = resp.json()["data"]
    if not data:
        raise SystemExit("the API serves no model yet (no live worker)")
    return data[0]["id"]


def _next_gap(rng: random.Random, rate: float) -> float:
    return 0.0 if rate == float("inf") else rng.expovariate(rate)


async def _gated(gate: asyncio.Semaphore, http, model: str, prompt: str, max_tokens: int) -> RequestResult:
    async with gate:
        return await one_request(http, model, prompt, max_tokens)


async def one_request(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(ok=False)
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                last = _on_line(line, result, start, last)
        result.ok = result.ttft_s is not None
        result.e2e_s = time.perf_counter() - start
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def _on_line(line: str, result: RequestResult, start: float, last: float) -> float:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return last
    chunk = json.loads(line[6:])
    if chunk.get("usage"):
        result.output_tokens = chunk["usage"]["completion_tokens"]
    if not chunk.get("choices") or not chunk["choices"][0].get("text"):
        return last
    now = time.perf_counter()
    if result.ttft_s is None:
        result.ttft_s = now - start
    else:
        result.itl_s.append(now - last)
    return now


def summarize(results: list[RequestResult], elapsed: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "config": {k: v for k, v in vars(args).items() if k in ("num_prompts", "request_rate", "max_concurrency",
                                                              "output_len", "input_words", "base_url",
                                                              "long_fraction", "long_input_words")},
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": round(elapsed, 3),
        "requests_per_s": round(len(ok) / elapsed, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]),
        "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
    }


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 6)

    return {"mean": round(sum(ordered) / len(ordered), 6), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def format_report(r: dict[str, Any]) -> str:
    lines = [f"completed {r['completed']}  failed {r['failed']}  duration {r['duration_s']:.2f} s",
             f"throughput {r['requests_per_s']:.2f} req/s, {r['output_tokens_per_s']:.1f} output tok/s",
             f"{'metric':<8} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}"]
    for key in ("ttft_s", "itl_s", "e2e_s"):
        p = r[key]
        cells = " ".join(f"{p[q] * 1000:>8.1f}ms" if p[q] is not None else f"{'-':>9}" for q in ("mean", "p50", "p90", "p99"))
        lines.append(f"{key[:-2]:<8} {cells}")
    for error in r["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
