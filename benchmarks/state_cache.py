"""The prefix cache of a model with linear attention or Mamba2 (Qwen3.5, Granite 4.0-H), which keeps the layers' states
every `mamba_block_size` tokens beside the KV blocks: with those states (the default) against
none kept (`num_state_snapshots=0`, where such a model has no prefix cache), in one run.

    python benchmarks/state_cache.py [--arch qwen3_5] [--conversations 6] [--system 1024] [--context 256] [--turns 3]
    python benchmarks/state_cache.py --snapshots 4 --offload 1   # with a host tier against without

The default model's shape (SmolLM2-135M: 30 layers) remade as Qwen3.5 (three linear-attention
layers of four), Granite 4.0-H (`--arch granitemoehybrid`: five Mamba2 layers of six) or
Nemotron-H (`--arch nemotron_h`: one-part layers, Mamba2, attention or MLP), with seeded
random weights (load_format dummy). Every conversation starts
with the same system prompt of `--system` random tokens, then a context of its own; each
round sends every conversation's next turn (its history, the last reply and a new 32-token
message), two at a time. Prints per mode the prompt tokens computed (not served from the
cache) and the seconds of the rounds after the first; then the ratios states / none. With
`--offload GiB`, both modes keep `--snapshots` states on the device, one with KV offloading's
host tier (which keeps the states evicted from the device), the other without.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from gpu_check import remake

from producer.sampling_params import SamplingParams
from worker import LLM

MESSAGE, REPLY = 32, 16  # tokens a turn adds, and a reply's


def run(model: str, args: argparse.Namespace, snapshots: int | None, offload: float | None = None) -> dict[str, float]:
    llm = LLM(model, dtype=args.dtype, load_format="dummy", max_model_len=4096, max_num_seqs=2,
              mamba_block_size=args.interval, num_state_snapshots=snapshots, kv_offloading_size=offload)
    stats = llm.engine.block_manager.stats
    rng = random.Random(0)
    system = [rng.randrange(3, 49152) for _ in range(args.system)]
    histories = [system + [rng.randrange(3, 49152) for _ in range(args.context)] for _ in range(args.conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=REPLY, ignore_eos=True)
    computed, elapsed = 0, 0.0
    for turn in range(args.turns):
        prompts = [h + [rng.randrange(3, 49152) for _ in range(MESSAGE)] for h in histories]
        before = stats.queries - stats.hits
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if turn:  # the first round computes every conversation once (the system prompt aside), in both modes
            elapsed += time.perf_counter() - start
            computed += stats.queries - stats.hits - before if snapshots != 0 else sum(map(len, prompts))
        histories = [p + o.outputs[0].token_ids for p, o in zip(prompts, outputs, strict=True)]
    return {"computed": computed, "elapsed_s": elapsed, "snapshots": llm.engine.runner.states.num_saved}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3_5", choices=["qwen3_5", "granitemoehybrid", "nemotron_h"])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--interval", type=int, default=512)  # mamba_block_size
    ap.add_argument("--dtype", default="float32")  # bfloat16 where the CPU has AVX-512 bf16
    ap.add_argument("--snapshots", type=int, default=None)  # num_state_snapshots (None: the engine's default)
    ap.add_argument("--offload", type=float, default=None,  # kv_offloading_size: compare with and without it
                    help="GiB of host memory: the states kept with and without this host tier")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = remake(None, args.arch, tmp)
        if args.offload:  # a few saved slots on the device, with and without the host tier
            rows = {"host": run(model, args, args.snapshots, args.offload), "device": run(model, args, args.snapshots)}
        else:
            rows = {"states": run(model, args, args.snapshots), "none": run(model, args, 0)}
    print(f"SmolLM2-135M remade as {args.arch} (dummy weights, {args.dtype}), {args.conversations} conversations: "
          f"a shared system prompt of {args.system} tokens, {args.context} of their own, {args.turns} turns, "
          f"a state kept every {args.interval} tokens; rounds 2..{args.turns}:")
    for name, row in rows.items():
        print(f"{name:<7} {row['computed']:>7} prompt tokens computed  ({row['snapshots']} states kept at most on "
              f"the device)  {row['elapsed_s']:6.1f} s")
    (_, ours), (_, base) = rows.items()
    print(f"{' / '.join(rows)}: prompt tokens computed {ours['computed'] / base['computed']:.2f}x  "
          f"time {ours['elapsed_s'] / base['elapsed_s']:.2f}x")


if __name__ == "__main__":
    main()
