"""Mixture-of-experts throughput on the CPU: the engine against transformers' `generate` on
the same random weights, in one run, beside the dense model of the same shape.

    python benchmarks/moe.py [--num-prompts 32] [--dtype bfloat16] [--experts 32] [--top-k 4]

The default model's shape (SmolLM2-135M: 30 layers, hidden 576) is remade as a Qwen3-MoE
whose every layer routes each token to `--top-k` of `--experts` experts of width
1536 / top-k, so a token's active MLP has the dense model's width: the MoE costs the same
matmul work per token, spread over experts. Weights are seeded random (load_format dummy:
speed does not depend on their values). Prints output tokens per second of each, and the
ratios engine / transformers (the MoE) and MoE / dense (the engine).
"""

from __future__ import annotations

import argparse
import tempfile

from gpu_check import remake

from worker.benchmarks.throughput import run_engine, run_hf
from worker.benchmarks.workload import RandomWorkload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hf-batch", type=int, default=16)
    args = ap.parse_args()
    workload = RandomWorkload(num_prompts=args.num_prompts, input_len_range=(32, 256), output_len_range=(16, 128))
    engine_args = {"load_format": "dummy", "max_model_len": 2048, "max_num_seqs": 64}
    with tempfile.TemporaryDirectory() as tmp:
        moe = remake(None, "qwen3_moe", tmp, num_experts=args.experts, num_experts_per_tok=args.top_k,
                     moe_intermediate_size=1536 // args.top_k, mlp_only_layers=[])
        rows = {
            "engine, MoE": run_engine(moe, args.dtype, workload, engine_args),
            "transformers, MoE": run_hf(moe, args.dtype, workload, args.hf_batch, load_format="dummy"),
            "engine, dense": run_engine(None, args.dtype, workload, engine_args),
        }
    for name, row in rows.items():
        print(f"{name:<20} {row['output_tokens_per_s']:>9.1f} out tok/s  ({row['elapsed_s']:.1f} s)")
    tok = {name: row["output_tokens_per_s"] for name, row in rows.items()}
    print(f"MoE engine / transformers  {tok['engine, MoE'] / tok['transformers, MoE']:.2f}x")
    print(f"engine MoE / dense         {tok['engine, MoE'] / tok['engine, dense']:.2f}x")


if __name__ == "__main__":
    main()
