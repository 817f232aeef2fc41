"""The hybrid KV cache on a model that mixes full and sliding-window (or chunked) layers: the same KV
memory with the windowed layers in a pool of their own (the default) and with every layer in
one pool (`disable_hybrid_kv_cache_manager`), on a long-context workload, in one run.

    python benchmarks/hybrid_kv.py [--arch gemma3] [--window 256] [--kv-gb 0.27] [--num-prompts 24]

The default model's shape (SmolLM2-135M: 30 layers) is remade as Gemma 3 (five windowed
layers in six), Gemma 2 (every other layer) or Llama 4 (chunked attention, chunks of
`--window`, on three layers of four, kept as windows that wide), with seeded random weights
(load_format dummy). Prompts of 1024..1536 tokens and 128..256 output tokens, up to 16 at once, in a
cache sized to hold about seven of the longest in one pool. Prints per layout: the pool's
blocks, how many layers' KV a block holds and how many of the longest requests the pool
holds, preemptions (requests whose KV was dropped for lack of room
and recomputed), output and total tokens per second; then the ratios hybrid / one pool.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from gpu_check import remake

from worker import LLM
from worker.benchmarks.workload import RandomWorkload


def run(model: str, workload: RandomWorkload, engine_args: dict) -> dict[str, float]:
    llm = LLM(model, **engine_args)
    engine = llm.engine
    prompts, params = workload.prompts(), workload.sampling_params()
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up
    preempted = engine.scheduler.num_preemptions
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    blocks = engine.block_manager
    return {"blocks": blocks.num_blocks, "slots": engine.runner.num_slots,
            "fits": blocks.num_blocks // blocks.blocks_needed(max(len(ids) + n for ids, n in workload.requests())),
            "preemptions": engine.scheduler.num_preemptions - preempted, "out_tok_s": num_out / elapsed,
            "tok_s": (num_in + num_out) / elapsed, "elapsed_s": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="gemma3", choices=["gemma3", "gemma2", "llama4"])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--kv-gb", type=float, default=0.27)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    workload = RandomWorkload(num_prompts=args.num_prompts, input_len_range=(1024, 1536), output_len_range=(128, 256))
    engine_args = {"dtype": args.dtype, "load_format": "dummy", "max_model_len": 4096, "max_num_seqs": 16,
                   "kv_cache_memory_gb": args.kv_gb}
    with tempfile.TemporaryDirectory() as tmp:
        span = {"attention_chunk_size": args.window} if args.arch == "llama4" else {"sliding_window": args.window}
        model = remake(None, args.arch, tmp, **span)
        rows = {"hybrid": run(model, workload, engine_args),
                "one pool": run(model, workload, {**engine_args, "disable_hybrid_kv_cache_manager": True})}
    print(f"{args.arch} remade from SmolLM2-135M, window {args.window}, {args.kv_gb} GB of KV, "
          f"{args.num_prompts} prompts of 1024..1536 tokens, 128..256 out")
    for name, row in rows.items():
        print(f"{name:<9} {row['blocks']:>5} blocks of {row['slots']:>2} layers, {row['fits']:>3} longest requests  "
              f"preemptions {row['preemptions']:>3}  {row['out_tok_s']:>7.1f} out tok/s  {row['tok_s']:>8.1f} tok/s  "
              f"({row['elapsed_s']:.1f} s)")
    hybrid, one = rows["hybrid"], rows["one pool"]
    print(f"hybrid / one pool: longest requests held {hybrid['fits'] / one['fits']:.2f}x  output tok/s {hybrid['out_tok_s'] / one['out_tok_s']:.2f}x  tok/s {hybrid['tok_s'] / one['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
