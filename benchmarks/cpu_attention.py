"""Decode attention on the CPU: the torch path (a gather of whole blocks, two matmuls per KV
head) against genq's compiled kernel (kernels.cpu, blocks read in place), same data, same run.

    python benchmarks/cpu_attention.py [--shapes 128x200,512x200,128x1000,4x4000,8x256p] [--dtype bfloat16] [--threads 1]
        [--layers 30]

Each shape is sequences x context (decodes), or with a trailing p whole prompts; heads are the default model's (SmolLM2-135M: 9 query heads,
3 KV heads, head_dim 64), blocks of 16, each sequence's blocks scattered over the pool. A row
times one layer's attention (the median of --repeats calls, the two paths called in turn; each
call runs --layers layers' caches in turn and counts as their mean, so that as in a model's step
the K/V come from memory, not from the last call's cache), the kernel's K/V reads per second,
and, apart, each path's per-step metadata (built once a step for all 30 layers).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels import cpu as cpu_kernels
from worker.core.scheduler import ScheduledRequest
from worker.model_executor.attention import TorchAttention, paged_attention, write_kv
from worker.model_executor.attention_cpu import CpuAttention

BLOCK_SIZE = 16
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def median_ms(fn, repeats: int) -> float:
    return interleaved_ms([fn], repeats)[0]


def interleaved_ms(fns, repeats: int) -> list[float]:
    """Each function's median time, the functions called in turn (on a shared machine each
    then sees the same load)."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) * 1e3 for spent in times]


def bench_shape(num_seqs: int, context: int, dtype: torch.dtype, repeats: int, prefill: bool = False,
                layers: int = 1) -> dict[str, float]:
    """Decodes of a context uniform in [context / 2, context * 3 / 2], or (`prefill`) whole
    prompts of `context` tokens."""
    gen = torch.Generator().manual_seed(0)
    if prefill:
        lens = [0] * num_seqs
    else:
        lens = torch.randint(max(context // 2, 1), context * 3 // 2 + 1, (num_seqs,), generator=gen).tolist()
    q_len = context if prefill else 1
    blocks = [-(-(n + q_len) // BLOCK_SIZE) for n in lens]
    order = torch.randperm(sum(blocks) + 1, generator=gen)[1:].tolist()
    batch, at = [], 0
    for i, (n, b) in enumerate(zip(lens, blocks, strict=True)):
        batch.append(ScheduledRequest(str(i), [1] * q_len, n, order[at : at + b], True))
        at += b
    batch.sort(key=lambda s: s.start_pos)  # as the runner orders decodes
    width = max(blocks)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in batch])
    positions = torch.tensor([s.start_pos + j for s in batch for j in range(q_len)])
    rows = torch.tensor([i for i in range(num_seqs) for _ in range(q_len)])
    slots = tables[rows, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    caches = torch.randn(layers, 2, sum(blocks) + 1, KV_HEADS, BLOCK_SIZE, HEAD_DIM, generator=gen).to(dtype)
    cache = caches[0]
    q = torch.randn(num_seqs * q_len, HEADS, HEAD_DIM, generator=gen).to(dtype)
    kv = torch.randn(num_seqs * q_len, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    args = (BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"))
    reference, compiled = TorchAttention(*args), CpuAttention(*args)
    ref_meta, meta = reference.build(batch, tables, slots), compiled.build(batch, tables, slots)
    write_kv(kv, kv, cache[0], cache[1], ref_meta)  # (the kernel reads this step's K/V from the cache)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    expected = paged_attention(q, kv, kv, cache[0], cache[1], ref_meta, scale)
    got = cpu_kernels.paged_attention(out, q, cache[0], cache[1], meta.block_tables, meta.query_start,
                                      meta.seq_lens, scale)
    error = (got.float() - expected.float()).abs().max().item()
    for layer in caches[1:]:
        write_kv(kv, kv, layer[0], layer[1], ref_meta)

    def torch_path() -> None:
        for layer in caches:
            paged_attention(q, kv, kv, layer[0], layer[1], ref_meta, scale)

    def kernel() -> None:
        for layer in caches:
            cpu_kernels.paged_attention(out, q, layer[0], layer[1], meta.block_tables, meta.query_start,
                                        meta.seq_lens, scale)

    torch_ms, kernel_ms = (ms / layers for ms in interleaved_ms([torch_path, kernel], repeats))
    kv_bytes = 2 * sum(s.start_pos + q_len for s in batch) * KV_HEADS * HEAD_DIM * cache.element_size()
    torch_build_ms = median_ms(lambda: reference.build(batch, tables, slots), repeats)
    kernel_build_ms = median_ms(lambda: compiled.build(batch, tables, slots), repeats)
    return {"torch_ms": torch_ms, "kernel_ms": kernel_ms, "speedup": torch_ms / kernel_ms,
            "kernel_gb_s": kv_bytes / kernel_ms / 1e6,
            "torch_build_ms": torch_build_ms, "kernel_build_ms": kernel_build_ms, "max_abs_err": error}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="128x200,512x200,128x1000,4x4000,8x256p",
                   help="sequences x context, comma-separated; a trailing p: whole prompts of that length")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own)")
    p.add_argument("--layers", type=int, default=30, help="caches a call runs through, one per layer (1: the "
                   "same cache every call, in the CPU's caches where it fits)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_kernels.load():
        raise SystemExit("genq's CPU kernels could not be built here (see the warning above)")
    dtype = getattr(torch, args.dtype)
    print(f"threads {torch.get_num_threads()}, {args.dtype}, heads {HEADS}/{KV_HEADS}, head_dim {HEAD_DIM}")
    print(f"{'seqs x ctx':>12} {'torch ms':>9} {'kernel ms':>10} {'speedup':>8} {'kernel GB/s':>12} "
          f"{'build torch':>12} {'build kernel':>13} {'max err':>8}")
    for shape in args.shapes.split(","):
        num_seqs, context = (int(x) for x in shape.rstrip("p").split("x"))
        r = bench_shape(num_seqs, context, dtype, args.repeats, prefill=shape.endswith("p"), layers=args.layers)
        print(f"{shape:>12} {r['torch_ms']:>9.2f} {r['kernel_ms']:>10.2f} {r['speedup']:>7.2f}x {r['kernel_gb_s']:>12.1f} "
              f"{r['torch_build_ms']:>12.2f} {r['kernel_build_ms']:>13.2f} {r['max_abs_err']:>8.4f}")


if __name__ == "__main__":
    main()
