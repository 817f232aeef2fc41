"""The GPU check (run on a CUDA machine; under 5 minutes):

1. every Triton kernel against its torch reference at real sizes, timed with
   `triton.testing.do_bench` (median), bandwidth beside a device-to-device copy of the same bytes;
2. greedy outputs of the engine on CUDA against the CPU path (float32: equal; bfloat16: close);
3. W1 through the engine (default model, bfloat16) and through transformers' `generate` on the
   same GPU, both throughputs and the ratio.

    python benchmarks/gpu_check.py [--num-prompts 128] [--skip-kernels]

Prints a short table last.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def check_engine_vs_cpu(num_tokens: int = 32) -> list[str]:
    from worker import LLM, SamplingParams

    prompts = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "1, 2, 3,"]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    lines = []
    for dtype in ("float32", "bfloat16"):
        cpu = LLM(dtype=dtype, device="cpu", max_model_len=2048).generate(prompts, params, use_tqdm=False)
        gpu = LLM(dtype=dtype, device="cuda", max_model_len=2048).generate(prompts, params, use_tqdm=False)
        same = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(cpu, gpu, strict=True)]
        prefix = [_common_prefix(a.outputs[0].token_ids, b.outputs[0].token_ids) for a, b in zip(cpu, gpu, strict=True)]
        lines.append(f"greedy cuda vs cpu {dtype:<9} identical {sum(same)}/{len(same)}  common prefix {prefix}")
    return lines


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_w1(num_prompts: int) -> list[str]:
    from worker.bench import run_engine, run_hf
    from worker.bench_workload import RandomWorkload

    workload = RandomWorkload(num_prompts=num_prompts)
    engine = run_engine(None, "bfloat16", workload, {"device": "cuda", "max_model_len": 2048, "max_num_seqs": 256})
    torch.cuda.empty_cache()
    hf = run_hf(None, "bfloat16", workload, batch_size=32)
    ratio = engine["output_tokens_per_s"] / hf["output_tokens_per_s"]
    return [
        f"W1 engine (cuda, bf16)      {engine['output_tokens_per_s']:>10.1f} out tok/s",
        f"W1 transformers (cuda, bf16){hf['output_tokens_per_s']:>10.1f} out tok/s",
        f"W1 ratio engine / hf        {ratio:>10.2f}x",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--skip-kernels", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU check needs one", file=sys.stderr)
        return 2
    start = time.time()
    summary = [f"device: {torch.cuda.get_device_name()}"]
    if not args.skip_kernels:
        from kernels.bench import check_kernels, format_rows

        rows = check_kernels()
        print(format_rows(rows), flush=True)
        bad = [r for r in rows if not r.get("ok", True)]
        summary.append(f"kernels: {len(rows) - len(bad)}/{len(rows)} match their references")
    summary += check_engine_vs_cpu()
    summary += check_w1(args.num_prompts)
    summary.append(f"elapsed {time.time() - start:.0f} s")
    print("\n".join(["", "== GPU check ==", *summary]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
