"""The compute floor of a throughput workload: its FLOPs at the GEMM rate this machine reaches
in the run's dtype, measured in the same run. No engine can run the workload faster than that
(it is the time the matmuls alone take at their best rate), so a mode's share of it, floor time
/ mode time, says how much of the hardware the mode uses.

FLOPs (a multiply-add is 2):
- the layers' matmuls: 2 x (the decoder's projection weights a token meets) x tokens processed;
  a request processes its prompt and every output token but the last (which is not fed back);
- the LM head: 2 x vocab x hidden per output token (one row of logits per sampled token);
- attention: QK and PV, 2 x 2 x heads x head_dim x (keys seen) per token and layer, a token at
  position p seeing p + 1 keys (the whole context: windows are not counted, a floor still).
Embedding lookups, norms, rotary and softmax are left out (not matmuls).

A decode's attention does 2 multiply-adds per key and head per byte of K/V it reads (bf16):
no CPU reads memory at its GEMM rate, so there attention is bound by memory, not FLOPs. The
memory-aware floor counts it so: the matmuls at the GEMM rate, attention at the slower of its
FLOPs at that rate and its K/V reads at the read rate measured in the same run (a float32 sum
over a buffer larger than the caches). K/V reads: each decode step reads its whole context
(every layer, K and V, each KV head once); a prompt reads its own keys once (a floor: chunks
and query tiles read them more)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

# the GEMM timed: [rows, hidden] x [hidden, intermediate], the MLP's up projection (the largest
# of a dense layer's matmuls) at the rows of W1's decode batches and its prefill chunks
GEMM_ROWS = (128, 512)
GEMM_REPEATS = 5


@dataclass(frozen=True)
class FloorShape:
    """What of a model's shape its FLOPs per token follow."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    mlp_params: int  # per layer and token: the dense MLP's, or the experts' a token runs (and the router)
    intermediate_size: int  # the width of the GEMM timed

    @classmethod
    def from_model_config(cls, cfg: Any) -> FloorShape:
        """From worker.model_executor.models.config.ModelConfig. ValueError for the shapes not
        counted here: latent attention, linear attention, MoE on some layers only."""
        if cfg.mla is not None or cfg.linear is not None or cfg.mlp_only_layers:
            raise ValueError(f"{cfg.architecture}: the floor counts dense or MoE attention models only")
        h = cfg.hidden_size
        mlp = 3 * h * cfg.intermediate_size
        if cfg.moe is not None:
            if len(cfg.moe.layers) != cfg.num_hidden_layers:
                raise ValueError(f"{cfg.architecture}: the floor counts models with experts on every layer only")
            moe = cfg.moe
            mlp = (moe.top_k * 3 * h * moe.intermediate_size + 3 * h * moe.shared_expert_size
                   + h * moe.num_experts)
        return cls(h, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                   cfg.head_dim, cfg.vocab_size, mlp, cfg.intermediate_size)

    @property
    def params_per_token(self) -> int:
        """The projection weights one token meets in one layer: q, k, v, o and the MLP."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden_size * (2 * q + 2 * kv) + self.mlp_params


def workload_flops(shape: FloorShape, requests: list[tuple[int, int]]) -> dict[str, int]:
    """The FLOPs of (prompt length, output length) requests, by part, and their total."""
    matmul = lm_head = attention = 0
    per_key = 4 * shape.num_heads * shape.head_dim * shape.num_layers  # QK and PV, every layer
    for n_in, n_out in requests:
        processed = n_in + n_out - 1
        matmul += 2 * shape.params_per_token * shape.num_layers * processed
        lm_head += 2 * shape.vocab_size * shape.hidden_size * n_out
        attention += per_key * processed * (processed + 1) // 2  # sum of p + 1 over p < processed
    return {"matmul": matmul, "lm_head": lm_head, "attention": attention,
            "total": matmul + lm_head + attention}


def workload_kv_bytes(shape: FloorShape, requests: list[tuple[int, int]], elem_bytes: int) -> int:
    """The K/V bytes attention reads for (prompt length, output length) requests: a decode step
    feeding the token at position p reads p + 1 keys; a prompt reads its own keys once."""
    per_key = 2 * shape.num_kv_heads * shape.head_dim * elem_bytes * shape.num_layers
    keys = 0
    for n_in, n_out in requests:
        steps = max(n_out - 1, 0)  # (the first output comes from the prompt's own step)
        keys += n_in + steps * (n_in + 1) + steps * (steps - 1) // 2
    return per_key * keys


READ_BUFFER_BYTES = 256 << 20  # larger than any CPU's last-level cache here


def measure_read_rate() -> float:
    """Bytes/s the CPU reads (a float32 sum over READ_BUFFER_BYTES, torch's threads), best of 3."""
    import torch

    buf = torch.ones(READ_BUFFER_BYTES // 4)
    buf.sum()  # (the pages)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        buf.sum()
        best = max(best, READ_BUFFER_BYTES / (time.perf_counter() - start))
    return best


def measure_gemm_rate(dtype: str, hidden: int, intermediate: int) -> dict[str, Any]:
    """FLOP/s of torch.matmul [rows, hidden] x [hidden, intermediate] in `dtype` on the CPU,
    the best of GEMM_REPEATS timings (each long enough to time: ~50 ms) over GEMM_ROWS."""
    import torch

    torch_dtype = getattr(torch, dtype)
    best = 0.0
    for rows in GEMM_ROWS:
        a = torch.randn(rows, hidden).to(torch_dtype)
        b = torch.randn(hidden, intermediate).to(torch_dtype)
        flops = 2 * rows * hidden * intermediate
        torch.matmul(a, b)  # warm-up (oneDNN's primitive, the pages)
        start = time.perf_counter()
        torch.matmul(a, b)
        reps = max(1, int(0.05 / max(time.perf_counter() - start, 1e-6)))
        for _ in range(GEMM_REPEATS):
            start = time.perf_counter()
            for _ in range(reps):
                torch.matmul(a, b)
            best = max(best, flops * reps / (time.perf_counter() - start))
    return {"flops_per_s": best, "gemm": f"[{'|'.join(map(str, GEMM_ROWS))}, {hidden}] x [{hidden}, "
                                         f"{intermediate}] {dtype}, best of {GEMM_REPEATS}",
            "threads": torch.get_num_threads()}


def compute_floor(model: str | None, dtype: str, requests: list[tuple[int, int]]) -> dict[str, Any]:
    """The workload's FLOPs, the GEMM rate measured now, and the floor: its time and tok/s."""
    from worker.model_executor.model_loader import read_config, resolve_model_path
    from worker.model_executor.models.config import ModelConfig, language_config

    cfg = ModelConfig.from_hf(language_config(read_config(resolve_model_path(model))))
    shape = FloorShape.from_model_config(cfg)
    flops = workload_flops(shape, requests)
    rate = measure_gemm_rate(dtype, shape.hidden_size, shape.intermediate_size)
    floor_s = flops["total"] / rate["flops_per_s"]
    kv_bytes = workload_kv_bytes(shape, requests, 4 if dtype == "float32" else 2)
    read_rate = measure_read_rate()
    attention_s = max(flops["attention"] / rate["flops_per_s"], kv_bytes / read_rate)
    memory_floor_s = (flops["matmul"] + flops["lm_head"]) / rate["flops_per_s"] + attention_s
    num_out = sum(n for _, n in requests)
    return {"flops": flops, **rate, "floor_s": round(floor_s, 4), "output_tokens_per_s": round(num_out / floor_s, 1),
            "kv_bytes": kv_bytes, "read_bytes_per_s": read_rate, "memory_floor_s": round(memory_floor_s, 4),
            "memory_floor_tokens_per_s": round(num_out / memory_floor_s, 1)}


def add_shares(floor: dict[str, Any], results: dict[str, dict[str, Any]]) -> None:
    """Each mode's share of the floor and of the memory-aware floor: floor time / its time."""
    for r in results.values():
        r["share_of_floor"] = round(floor["floor_s"] / r["elapsed_s"], 3)
        r["share_of_memory_floor"] = round(floor["memory_floor_s"] / r["elapsed_s"], 3)


def format_floor(floor: dict[str, Any]) -> str:
    gflop = floor["flops"]["total"] / 1e9
    return (f"compute floor: {gflop:.1f} GFLOP at {floor['flops_per_s'] / 1e9:.1f} GFLOP/s "
            f"({floor['gemm']}, {floor['threads']} threads) = {floor['floor_s']:.2f} s, "
            f"{floor['output_tokens_per_s']:.1f} out tok/s\n"
            f"memory-aware floor: attention's {floor['kv_bytes'] / 1e9:.1f} GB of K/V reads at "
            f"{floor['read_bytes_per_s'] / 1e9:.1f} GB/s where slower than its FLOPs = {floor['memory_floor_s']:.2f} s, "
            f"{floor['memory_floor_tokens_per_s']:.1f} out tok/s")
