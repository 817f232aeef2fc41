"""Linear layers on CPU: `F.linear` against the oneDNN-prepacked weights the engine uses
(`worker/model_executor/models/packed_linear.py`), at the row counts of decode and prefill steps, over as many
distinct weights as SmolLM2-135M has layers (so the weights come from memory, as in a step).

    python benchmarks/cpu_linear.py [--dtype bfloat16|float32] [--rows 1,8,32,128,512,2048] [--shape 3072x576]

Prints microseconds per layer for each and the speed-up; checks that the outputs are equal
(bitwise in bfloat16, the largest difference in float32, whose F.linear is MKL's sgemm).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from worker.model_executor.models.packed_linear import PackedLinear, can_pack

NUM_LAYERS = 30


def per_layer_us(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats / NUM_LAYERS * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,128,512,2048")
    ap.add_argument("--shape", default="3072x576", help="out x in features (gate_up of SmolLM2-135M)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if not can_pack(torch.device("cpu"), dtype):
        print(f"this CPU or torch build has no oneDNN {args.dtype}")
        return 2
    out_features, in_features = (int(x) for x in args.shape.split("x"))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(in_features, out_features, bias=False).to(dtype) for _ in range(NUM_LAYERS)]
    packed = [PackedLinear(layer, batch_hint=128) for layer in layers]
    print(f"{'rows':>6} {'F.linear us':>12} {'packed us':>10} {'speed-up':>9}  largest difference")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_features, dtype=dtype)
            repeats = max(3, 2048 // rows)
            plain_us = per_layer_us(lambda x=x: [F.linear(x, layer.weight) for layer in layers], repeats)
            packed_us = per_layer_us(lambda x=x: [p(x) for p in packed], repeats)
            diff = max((p(x) - F.linear(x, layer.weight)).abs().max().item() for p, layer in zip(packed, layers, strict=True))
            print(f"{rows:>6} {plain_us:>12.1f} {packed_us:>10.1f} {plain_us / packed_us:>8.2f}x  {diff:.2g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
