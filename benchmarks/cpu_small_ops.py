"""genq's fused CPU small ops (kernels/cpu/fused.cpp) against the torch path of the modules they
stand in for, at the default model's shapes (hidden 576, intermediate 1536, 9 + 3 heads of 64),
bf16, for a step of 128 and of 512 tokens: the residual add with its RMSNorm, SiLU(gate) * up,
the rotary rotation of q and k. Each the median of 200 calls, called in turn, and what a
step of the default model's 30 layers spends on them (61 norms, 30 MLPs, 30 rotations).

    python benchmarks/cpu_small_ops.py [--threads 1] [--tokens 128,512]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import cpu as cpu_kernels
from worker.model_executor.models.llama import RMSNorm, RotaryEmbedding, TableRope

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 576, 1536, 9, 3, 64, 30
BF16 = torch.bfloat16


def median_us(fn: Callable[[], object], calls: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def timings(tokens: int) -> dict[str, tuple[float, float, int]]:
    """op -> (torch us, fused us, calls a step)."""
    norm = RMSNorm(HIDDEN, 1e-5).to(BF16)
    x, residual = torch.randn(tokens, HIDDEN, dtype=BF16), torch.randn(tokens, HIDDEN, dtype=BF16)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, dtype=BF16)
    rotary = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)), 1.0, 4096)
    table = rotary.for_step(torch.randint(0, 4096, (tokens,)), BF16)
    assert isinstance(table, TableRope)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=BF16)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, HEADS + KV_HEADS, HEAD_DIM)

    def torch_mlp() -> torch.Tensor:  # (as MLP.forward: in place on the projection's output)
        gate, up = gate_up.clone().split(INTERMEDIATE, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)

    with torch.inference_mode():
        return {
            "add + RMSNorm": (median_us(lambda: norm(x, residual)),
                              median_us(lambda: cpu_kernels.add_rms_norm_(x, residual, norm.weight, 1e-5)),
                              2 * LAYERS + 1),
            "SiLU(gate) * up": (median_us(torch_mlp) - median_us(gate_up.clone),
                                median_us(lambda: cpu_kernels.silu_and_mul(gate_up)), LAYERS),
            "rotary of q, k": (median_us(lambda: table(qk, HEADS)),
                               median_us(lambda: cpu_kernels.rope_(qk, table.cos, table.sin)), LAYERS),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--tokens", default="128,512")
    args = ap.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("genq's CPU kernels could not be built here")
    torch.set_num_threads(args.threads)
    print(f"{'tokens':>6} {'op':<16} {'torch us':>9} {'fused us':>9} {'ratio':>6} {'a step, torch ms':>17} {'fused ms':>9}")
    for tokens in map(int, args.tokens.split(",")):
        total = [0.0, 0.0]
        for op, (slow, fast, calls) in timings(tokens).items():
            total[0] += slow * calls / 1e3
            total[1] += fast * calls / 1e3
            print(f"{tokens:>6} {op:<16} {slow:>9.1f} {fast:>9.1f} {slow / fast:>5.2f}x {slow * calls / 1e3:>17.2f} "
                  f"{fast * calls / 1e3:>9.2f}")
        print(f"{tokens:>6} {'all, a step':<16} {'':>9} {'':>9} {total[0] / total[1]:>5.2f}x {total[0]:>17.2f} {total[1]:>9.2f}")


if __name__ == "__main__":
    main()
