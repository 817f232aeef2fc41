"""Weights updates against starting over: how long `LLM.reload_weights` takes to serve another
checkpoint of the default model (SmolLM2-135M), from disk and from tensors in memory, against
building the engine anew on that checkpoint (what a worker restart costs, less the process's
own start), both measured here in the same run.

    python benchmarks/reload_weights.py [--dtype bfloat16|float32] [--repeats 3]

Prints the median seconds of each and the ratio to a new engine; checks that the engine's
greedy tokens after the update are those of an engine built on the new checkpoint.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from worker import LLM, SamplingParams
from worker.model_executor.model_loader import resolve_model_path

PROMPT = {"prompt_token_ids": list(range(100, 164))}


def moved(src: Path, out: Path) -> Path:
    """The checkpoint again with every floating-point tensor moved a little (a training step)."""
    shutil.copytree(src, out)
    generator = torch.Generator().manual_seed(0)
    for path in out.glob("*.safetensors"):
        tensors = {name: t + (torch.randn(t.shape, generator=generator) * 1e-2).to(t.dtype)
                   if t.is_floating_point() else t for name, t in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})
    return out


def seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = resolve_model_path(None)
    engine_args = {"dtype": args.dtype, "num_gpu_blocks_override": 256, "max_model_len": 1024}
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        new = moved(base, Path(tmp) / "step")
        tensors = {name: t for path in new.glob("*.safetensors") for name, t in load_file(path).items()}
        llm = LLM(str(base), **engine_args)
        fresh = seconds(lambda: LLM(str(new), **engine_args), args.repeats)
        from_disk = seconds(lambda: llm.reload_weights(new), args.repeats)
        in_memory = seconds(lambda: llm.reload_weights(weights=tensors.items()), args.repeats)
        served = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
        expected = LLM(str(new), **engine_args).generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
    print(f"{'':24} {'seconds':>8} {'x new engine':>13}")
    for name, value in (("new engine", fresh), ("reload_weights(path)", from_disk),
                        ("reload_weights(weights)", in_memory)):
        print(f"{name:24} {value:8.3f} {value / fresh:13.2f}")
    print("greedy tokens after the update equal a new engine's:", served == expected)
    return 0 if served == expected else 1


if __name__ == "__main__":
    raise SystemExit(main())
