"""KV offloading on multi-turn conversations whose contexts do not all fit the KV pool: the
same engine with and without `kv_offloading_size`, in one run.

    python benchmarks/kv_offload.py [--conversations 6] [--context 512] [--turns 3] [--pool-contexts 2]

The default model (SmolLM2-135M) with seeded random weights (load_format dummy). Each
conversation starts from a context of random tokens; each round sends every conversation's
next turn (its context so far, the last reply and a new 32-token message), two running at a
time, so a round's later conversations push the earlier ones' blocks out of a pool sized for
`--pool-contexts` contexts. Without offloading a conversation's next turn recomputes what was
pushed out; with it, the host tier (room for every context) copies it back. Prints per mode the
prompt tokens computed (not served by the prefix cache), those copied back from the host,
and the time of the rounds after the first; then the ratios offloading / none.
"""

from __future__ import annotations

import argparse
import random
import time

from producer.sampling_params import SamplingParams
from worker import LLM

MESSAGE, REPLY = 32, 16  # tokens a turn adds, and a reply's


def run(args: argparse.Namespace, offload_gb: float | None) -> dict[str, float]:
    blocks_per_context = -(-(args.context + args.turns * (MESSAGE + REPLY)) // 16)
    llm = LLM(None, dtype=args.dtype, load_format="dummy", max_model_len=blocks_per_context * 16, max_num_seqs=2,
              num_gpu_blocks_override=args.pool_contexts * blocks_per_context, kv_offloading_size=offload_gb)
    stats = llm.engine.block_manager.stats
    rng = random.Random(0)
    contexts = [[rng.randrange(3, 49152) for _ in range(args.context)] for _ in range(args.conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=REPLY, ignore_eos=True)
    computed = host = 0
    elapsed = 0.0
    for turn in range(args.turns):
        prompts = [ctx + [rng.randrange(3, 49152) for _ in range(MESSAGE)] for ctx in contexts]
        before = (stats.queries - stats.hits, stats.host_hits)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if turn:  # the first round computes every context once, in both modes
            elapsed += time.perf_counter() - start
            computed += stats.queries - stats.hits - before[0]
            host += stats.host_hits - before[1]
        contexts = [p + o.outputs[0].token_ids for p, o in zip(prompts, outputs, strict=True)]
    return {"computed": computed, "host": host, "elapsed_s": elapsed,
            "host_blocks": llm.engine.runner.num_host_blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--pool-contexts", type=int, default=2)
    ap.add_argument("--offload-gb", type=float, default=0.5)
    ap.add_argument("--dtype", default="float32")  # bfloat16 where the CPU has AVX-512 bf16
    args = ap.parse_args()
    rows = {"none": run(args, None), "offloading": run(args, args.offload_gb)}
    print(f"SmolLM2-135M (dummy weights, {args.dtype}), {args.conversations} conversations of {args.context} "
          f"tokens, {args.turns} turns, a pool for {args.pool_contexts} contexts; rounds 2..{args.turns}:")
    for name, row in rows.items():
        print(f"{name:<10} {row['computed']:>7} prompt tokens computed  {row['host']:>7} copied back "
              f"({row['host_blocks']} host blocks)  {row['elapsed_s']:6.1f} s")
    none, off = rows["none"], rows["offloading"]
    print(f"offloading / none: prompt tokens computed {off['computed'] / none['computed']:.2f}x  "
          f"time {off['elapsed_s'] / none['elapsed_s']:.2f}x")


if __name__ == "__main__":
    main()
