"""GPU check of the kernels at real sizes: correctness against the references, then speed.

`check_kernels()` is the kernel part of `benchmarks/gpu_check.py`. Each row times one
kernel with `triton.testing.do_bench` (median) and reports the bandwidth it achieved next to
a device-to-device `copy_` moving the same number of bytes (read + write) in the same run,
the practical ceiling for a memory-bound kernel on that GPU.
"""

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels._common import HAS_TRITON, cdiv, next_power_of_2
from kernels.dtw import dtw_trace, dtw_trace_ref
from kernels.fused_moe import fused_moe, fused_moe_ref
from kernels.kv_cache import reshape_and_cache, reshape_and_cache_ref
from kernels.paged_attention import paged_attention, paged_attention_ref
from kernels.quant_linear import dequantize_ref, quant_linear, quant_linear_ref
from kernels.recurrent import (
    StateSaves,
    causal_conv1d_step,
    causal_conv1d_step_ref,
    gated_delta_scan,
    gated_delta_scan_ref,
)
from kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref
from kernels.rotary import apply_rotary_emb, apply_rotary_emb_ref, build_cos_sin_cache
from kernels.sampling import top_k_top_p_sample, top_k_top_p_sample_ref

__all__ = ["HEAD_CONFIGS", "check_kernels", "format_rows"]

# a mixture-of-experts layer of Qwen3-30B-A3B's shape: (experts, top_k, hidden_size, intermediate)
MOE_SHAPE = (128, 8, 2048, 768)
# Llama-3-8B's gate/up projection (out, in), for the quantized-weight kernel
QUANT_SHAPE = (28672, 4096)
# the layers with states: (name, requests, tokens each, value heads, key_dim, value_dim, delta
# rule): Qwen3-Next-80B's Gated DeltaNet decoding and prefilling, Nemotron-H-8B's Mamba2 decoding
STATE_SHAPES = [("qwen3-next", 256, 1, 32, 128, 128, True), ("qwen3-next", 4, 1024, 32, 128, 128, True),
                ("nemotron-h-8b", 128, 1, 128, 128, 64, False)]
# name: (num_heads, num_kv_heads, head_dim, hidden_size, vocab_size)
HEAD_CONFIGS = {
    "smollm2-135m": (9, 3, 64, 576, 49152),
    "llama-8b": (32, 8, 128, 4096, 128256),
}
_DTYPE = torch.bfloat16
_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3}  # atol = rtol, as in the tests
_BLOCK_SIZE = 16


@dataclass
class _Case:
    kernel: str
    config: str
    shape: str
    run: Callable[[], object]  # the kernel launch that is timed
    compare: Callable[[], "_Error"]  # runs kernel and reference once
    bytes_moved: int  # minimum DRAM traffic of one launch, read + write
    flops: int = 0  # matmul flops of one launch (attention), 0 elsewhere


@dataclass(frozen=True)
class _Error:
    max_abs: float
    ok: bool  # within atol = rtol = _TOLERANCE everywhere


def check_kernels(configs: list[str] | None = None) -> list[dict[str, object]]:
    """Check and time every kernel on the current CUDA device; one row dict per case.

    Row keys: kernel, config, shape, dtype, max_abs_err, ok, ms, gb_per_s, copy_gb_per_s,
    pct_of_copy, tflop_per_s (attention's and fused MoE's matmuls; 0 for the others).
    Raises RuntimeError without a CUDA GPU (or under TRITON_INTERPRET=1).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("check_kernels needs a CUDA GPU; none is visible to torch")
    if not HAS_TRITON:
        raise RuntimeError("check_kernels needs Triton, which is not installed")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: check_kernels times the compiled kernels")
    device = torch.device("cuda")
    rows = []
    for config in configs or list(HEAD_CONFIGS):
        for case in _cases(config, device):
            rows.append(_measure(case))
    # DeepSeek-V3's latent attention: one cache head of 512 + 64 columns (1024-wide tiles), 16
    # query heads on it (128 over tensor parallelism of 8), and all 128 (shared out 16 to a program)
    for heads, query_lens, seq_lens in ((16, [1] * 64, [2048] * 64), (16, [512] * 4, [2048] * 4),
                                        (128, [1] * 16, [2048] * 16)):
        rows.append(_measure(_attention_case(f"mla-{heads}-heads", (heads, 1, 576), query_lens, seq_lens, None, device)))
    for num_tokens in (16, 2048):  # a decode step's tokens, a prefill's
        for experts in ("bf16", "fp8", "mxfp4"):
            rows.append(_measure(_fused_moe_case(num_tokens, device, experts)))
        rows.extend(_measure(case) for case in _quant_linear_cases(num_tokens, device))
    for shape in STATE_SHAPES:
        rows.append(_measure(_state_scan_case(*shape, device)))
    rows.append(_measure(_conv_step_case(256, 8192, device)))
    rows.append(_measure(_dtw_case(448, 1500, device)))
    return rows


def _dtw_case(rows: int, cols: int, device: torch.device) -> _Case:
    """Whisper's longest reply (448 tokens) warped onto its 30 s window's 1500 frames: the
    kernel's trace against numpy's (equal, step for step: max_abs_err counts the cells that
    differ)."""
    cost = torch.randn(rows, cols, device=device)

    def compare() -> _Error:
        differ = (dtw_trace(cost).cpu() != dtw_trace_ref(cost)).sum().item()
        return _Error(float(differ), differ == 0)

    block = next_power_of_2(rows + 1)  # the kernel's lanes
    num_bytes = cost.numel() * 4 + (rows + cols + 1) * block * 5  # the costs, each diagonal's sums and steps
    return _Case("dtw_trace", "whisper", f"{rows}x{cols}", lambda: dtw_trace(cost), compare, num_bytes)


def _measure(case: _Case) -> dict[str, object]:
    from triton.testing import do_bench

    error = case.compare()
    ms = do_bench(case.run, return_mode="median")
    copy_ms = _copy_ms(case.bytes_moved // 2)
    gb_per_s = case.bytes_moved / ms / 1e6
    copy_gb_per_s = 2 * (case.bytes_moved // 2) / copy_ms / 1e6
    return {
        "kernel": case.kernel,
        "config": case.config,
        "shape": case.shape,
        "dtype": str(_DTYPE).removeprefix("torch."),
        "max_abs_err": error.max_abs,
        "ok": error.ok,
        "ms": ms,
        "gb_per_s": gb_per_s,
        "copy_gb_per_s": copy_gb_per_s,
        "pct_of_copy": 100 * gb_per_s / copy_gb_per_s,
        "tflop_per_s": case.flops / ms / 1e9,
    }


def _copy_ms(num_bytes: int) -> float:
    from triton.testing import do_bench

    src = torch.empty(max(num_bytes, 1), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return do_bench(lambda: dst.copy_(src), return_mode="median")


def _cases(config: str, device: torch.device) -> list[_Case]:
    num_heads, num_kv_heads, head_dim, hidden, vocab_size = HEAD_CONFIGS[config]
    heads = (num_heads, num_kv_heads, head_dim)
    return [
        _attention_case(config, heads, [1] * 64, [2048] * 64, None, device),
        _attention_case(config, heads, [1] * 4, [8192] * 4, 1, device),
        _attention_case(config, heads, [1] * 4, [8192] * 4, None, device),
        _attention_case(config, heads, [512] * 4, [2048] * 4, None, device),
        # Llama 4's chunked layers: decodes 3808 positions into their chunk of 8192, and
        # prefill chunks that straddle a chunk's end (the tiles before each chunk skipped)
        _attention_case(config, heads, [1] * 4, [12000] * 4, None, device, chunk=8192),
        _attention_case(config, heads, [512] * 4, [8448] * 4, None, device, chunk=8192),
        _kv_cache_case(config, 4096, num_kv_heads, head_dim, device),
        _rms_norm_case(config, 4096, hidden, device),
        _rotary_case(config, 4096, heads, device),
        _sampling_case(config, 64, vocab_size, device),
    ]


def _compare(*pairs: tuple[torch.Tensor, torch.Tensor]) -> _Error:
    """(kernel output, reference) pairs."""
    tol = _TOLERANCE[_DTYPE]
    max_abs = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
    ok = all(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol) for a, b in pairs)
    return _Error(max_abs, ok)


def _attention_case(
    config: str,
    heads: tuple[int, int, int],
    query_lens: list[int],
    seq_lens: list[int],
    num_splits: int | None,
    device: torch.device,
    chunk: int | None = None,  # Llama 4's chunked attention: a query sees its own chunk only
) -> _Case:
    num_heads, num_kv_heads, head_dim = heads
    blocks_per_seq = [cdiv(s, _BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_seq)
    cache_shape = (num_blocks, _BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, device=device, dtype=_DTYPE)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=device, dtype=torch.int32)
    block_tables = block_tables.view(len(seq_lens), -1)  # equal lengths: [B, blocks_per_seq]
    starts = torch.tensor([0, *query_lens], device=device).cumsum(0).to(torch.int32)
    q = torch.randn(sum(query_lens), num_heads, head_dim, device=device, dtype=_DTYPE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (q, k_cache, v_cache, starts, lens, block_tables)
    run = functools.partial(
        paged_attention, *args,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), num_splits=num_splits, chunk_size=chunk,
    )  # fmt: skip

    def compare() -> _Error:
        return _compare((run(), paged_attention_ref(*args, chunk_size=chunk)))

    def first_seen(pos: int) -> int:
        return 0 if chunk is None else pos // chunk * chunk

    # the keys read: from the first query's chunk (all of them without chunks) to the end
    read = sum(s - first_seen(s - q_len) for q_len, s in zip(query_lens, seq_lens, strict=True))
    kv_bytes = 2 * read * num_kv_heads * head_dim * k_cache.element_size()
    split = "auto" if num_splits is None else str(num_splits)
    shape = f"B={len(seq_lens)} q={max(query_lens)} ctx={max(seq_lens)} splits={split}"
    shape += "" if chunk is None else f" chunk={chunk}"
    # Each new token at position p sees the keys from its chunk's start (0 without chunks) to
    # itself: QK^T and PV, 2 flops a MAC.
    visible = sum(p + 1 - first_seen(p) for q_len, s in zip(query_lens, seq_lens, strict=True)
                  for p in range(s - q_len, s))
    flops = 4 * visible * num_heads * head_dim
    return _Case("paged_attention", config, shape, run,
                 compare, kv_bytes + 2 * q.numel() * q.element_size(), flops)  # fmt: skip


def _kv_cache_case(
    config: str, num_tokens: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> _Case:
    num_blocks = cdiv(num_tokens, _BLOCK_SIZE) * 2
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device, dtype=_DTYPE)
    value = torch.randn_like(key)
    k_cache = torch.randn(num_blocks, _BLOCK_SIZE, num_kv_heads, head_dim, device=device,
                          dtype=_DTYPE)  # fmt: skip
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * _BLOCK_SIZE, device=device)[:num_tokens]

    def compare() -> _Error:
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        reshape_and_cache(key, value, k_cache, v_cache, slots)
        reshape_and_cache_ref(key, value, ref_k, ref_v, slots)
        return _compare((k_cache, ref_k), (v_cache, ref_v))

    def run() -> None:
        reshape_and_cache(key, value, k_cache, v_cache, slots)

    num_bytes = 4 * key.numel() * key.element_size() + slots.numel() * 8
    return _Case("reshape_and_cache", config, f"T={num_tokens}", run, compare, num_bytes)


def _rms_norm_case(config: str, num_tokens: int, hidden: int, device: torch.device) -> _Case:
    x = torch.randn(num_tokens, hidden, device=device, dtype=_DTYPE)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device=device, dtype=_DTYPE)

    def compare() -> _Error:
        out, res = fused_add_rms_norm(x, residual, weight)
        return _compare(*zip((out, res), fused_add_rms_norm_ref(x, residual, weight), strict=True))

    num_bytes = 4 * x.numel() * x.element_size()
    return _Case("fused_add_rms_norm", config, f"T={num_tokens} hidden={hidden}",
                 lambda: fused_add_rms_norm(x, residual, weight), compare, num_bytes)  # fmt: skip


def _rotary_case(
    config: str, num_tokens: int, heads: tuple[int, int, int], device: torch.device
) -> _Case:
    num_heads, num_kv_heads, head_dim = heads
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
    cos_sin = build_cos_sin_cache(inv_freq, 8192)
    positions = torch.randint(0, 8192, (num_tokens,), device=device)
    q = torch.randn(num_tokens, num_heads, head_dim, device=device, dtype=_DTYPE)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device, dtype=_DTYPE)

    def compare() -> _Error:
        ref_q, ref_k = apply_rotary_emb_ref(positions, q, k, cos_sin)
        apply_rotary_emb(positions, q, k, cos_sin)
        return _compare((q, ref_q), (k, ref_k))

    num_bytes = 2 * (q.numel() + k.numel()) * q.element_size() + num_tokens * head_dim * 4
    return _Case("apply_rotary_emb", config, f"T={num_tokens}",
                 lambda: apply_rotary_emb(positions, q, k, cos_sin), compare, num_bytes)  # fmt: skip


def _sampling_case(config: str, num_rows: int, vocab_size: int, device: torch.device) -> _Case:
    logits = (3 * torch.randn(num_rows, vocab_size, device=device)).to(_DTYPE)
    noise = torch.empty(num_rows, vocab_size, device=device).exponential_()
    top_k = torch.full((num_rows,), 50, dtype=torch.int32, device=device)
    top_k[::2] = 0  # half the rows: top-p only
    top_p = torch.full((num_rows,), 0.9, device=device)
    args = (logits, top_k, top_p, noise)

    def compare() -> _Error:
        same = torch.equal(top_k_top_p_sample(*args), top_k_top_p_sample_ref(*args))
        return _Error(0.0 if same else 1.0, same)

    # One pass over logits and noise; the bisection's repeated passes mostly hit L2.
    num_bytes = logits.numel() * logits.element_size() + noise.numel() * 4
    return _Case("top_k_top_p_sample", config, f"B={num_rows} V={vocab_size} k=50|0 p=0.9",
                 lambda: top_k_top_p_sample(*args), compare, num_bytes)  # fmt: skip


def _state_scan_case(config: str, num_requests: int, tokens: int, heads: int, key_dim: int, value_dim: int,
                     delta: bool, device: torch.device) -> _Case:
    """`tokens` rows of each request through the rule from its float32 state, in slots among
    twice as many; a prefill saves the state after its middle row."""
    rows = num_requests * tokens
    q, k = (torch.nn.functional.normalize(torch.randn(rows, heads, key_dim, device=device), dim=-1)
            for _ in "qk")  # fmt: skip
    v = torch.randn(rows, heads, value_dim, device=device)
    g = -torch.rand(rows, heads, device=device)
    beta = torch.rand(rows, heads, device=device) if delta else None
    state = torch.randn(2 * num_requests, heads, key_dim, value_dim, device=device)
    slots = torch.randperm(2 * num_requests, device=device)[:num_requests]
    starts = torch.arange(0, rows + 1, tokens, dtype=torch.int32, device=device)
    saves = None
    if tokens > 1:
        saves = StateSaves(torch.empty_like(state), torch.arange(num_requests + 1, dtype=torch.int32, device=device),
                           torch.full((num_requests,), tokens // 2, dtype=torch.int32, device=device), slots)
    args = (q, k, v, g, beta)

    def compare() -> _Error:
        ref_state = state.clone()
        ref_saves = saves and StateSaves(saves.saved.clone(), saves.index, saves.after, saves.slots)
        ref = gated_delta_scan_ref(*args, ref_state, slots, starts, ref_saves)
        pairs = [(gated_delta_scan(*args, state, slots, starts, saves), ref), (state, ref_state)]
        if saves is not None and ref_saves is not None:
            pairs.append((saves.saved[slots], ref_saves.saved[slots]))
        return _compare(*pairs)

    per_state = heads * key_dim * value_dim * 4
    num_bytes = num_requests * (2 + (tokens > 1)) * per_state + (q.numel() + k.numel() + 2 * v.numel()) * 4
    return _Case("gated_delta_scan", config, f"B={num_requests} T={tokens} H={heads} {key_dim}x{value_dim}",
                 lambda: gated_delta_scan(*args, state, slots, starts, saves), compare, num_bytes)  # fmt: skip


def _conv_step_case(num_rows: int, channels: int, device: torch.device) -> _Case:
    x = torch.randn(num_rows, channels, device=device, dtype=_DTYPE)
    state = torch.randn(2 * num_rows, channels, 3, device=device, dtype=_DTYPE)
    weight, bias = torch.randn(channels, 4, device=device, dtype=_DTYPE), torch.randn(channels, device=device,
                                                                                        dtype=_DTYPE)
    slots = torch.randperm(2 * num_rows, device=device)[:num_rows]

    def compare() -> _Error:
        ref_state = state.clone()
        ref = causal_conv1d_step_ref(x, ref_state, slots, weight, bias)
        return _compare((causal_conv1d_step(x, state, slots, weight, bias), ref), (state, ref_state))

    num_bytes = (2 * 3 + 2) * num_rows * channels * x.element_size()
    return _Case("causal_conv1d_step", "qwen3-next", f"B={num_rows} C={channels} K=4",
                 lambda: causal_conv1d_step(x, state, slots, weight, bias), compare, num_bytes)  # fmt: skip


def _fused_moe_case(num_tokens: int, device: torch.device, experts: str = "bf16") -> _Case:
    """One MoE layer (MOE_SHAPE), its experts in bf16, in fp8 with 128 x 128 scale blocks, or
    in MXFP4 (random e2m1 codes, a power of two per 32 columns: gpt-oss's); checked on its
    first 16 tokens (the dense reference gathers every token's experts' weights), timed on all."""
    num_experts, top_k, hidden, inter = MOE_SHAPE
    x = torch.randn(num_tokens, hidden, device=device, dtype=_DTYPE)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, device=device) * inter**-0.5
    scales: tuple = ()
    if experts == "fp8":
        (w13, s13), (w2, s2) = _fp8_blocks(w13), _fp8_blocks(w2)
        scales = (s13, s2, (128, 128))
    elif experts == "mxfp4":  # codes of magnitude about 2, times 2^-6: about the bf16 weights' size
        w13, w2 = (torch.randint(0, 256, (*w.shape[:-1], w.shape[-1] // 2), device=device, dtype=torch.uint8)
                   for w in (w13, w2))
        s13, s2 = (torch.full((*w.shape[:-1], w.shape[-1] // 16), 127 - 6, device=device, dtype=torch.uint8)
                   for w in (w13, w2))
        scales = (s13, s2, (1, 32))
    else:
        w13, w2 = w13.to(_DTYPE), w2.to(_DTYPE)
    probs = torch.softmax(torch.randn(num_tokens, num_experts, device=device), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(_DTYPE)

    def compare() -> _Error:
        n = min(num_tokens, 16)
        return _compare((fused_moe(x[:n], w13, w2, weights[:n], ids[:n], *scales),
                         fused_moe_ref(x[:n], w13, w2, weights[:n], ids[:n], *scales)))

    experts_hit = ids.unique().numel()
    weight_bytes = 3 * hidden * inter * (0.5 + 1 / 32 if experts == "mxfp4" else w13.element_size())
    num_bytes = int(experts_hit * weight_bytes) + 2 * x.numel() * x.element_size()
    flops = 2 * num_tokens * top_k * 3 * hidden * inter
    name = "fused_moe" if experts == "bf16" else f"fused_moe {experts}"
    return _Case(name, "qwen3-30b-a3b", f"T={num_tokens} E={num_experts} k={top_k}",
                 lambda: fused_moe(x, w13, w2, weights, ids, *scales), compare, num_bytes, flops)  # fmt: skip


def _fp8_blocks(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] (multiples of 128) as fp8 values and a scale per 128 x 128 block."""
    *lead, n, k = dense.shape
    tiles = dense.view(*lead, n // 128, 128, k // 128, 128)
    scale = tiles.abs().amax(dim=(-3, -1)) / 448.0
    return (tiles / scale[..., :, None, :, None]).view_as(dense).to(torch.float8_e4m3fn), scale


def _quant_linear_cases(num_tokens: int, device: torch.device) -> list[_Case]:
    """The quantized-weight kernel at QUANT_SHAPE over fp8 weights (128 x 128 scale blocks)
    and packed int4 weights (a scale per 128 columns, W4A16's; and with a zero point each,
    AWQ's and GPTQ's), and cuBLAS's bf16 product over
    the fp8 weight dequantized: the baseline their decode speed-ups (a half, a quarter of the
    weight bytes) are read against."""
    n, k = QUANT_SHAPE
    x = torch.randn(num_tokens, k, device=device, dtype=_DTYPE)
    dense = torch.randn(n, k, device=device) * k**-0.5
    fp8, fp8_scale = _fp8_blocks(dense)
    int4, int4_scale = _int4_groups(dense)
    bf16 = dequantize_ref(fp8, fp8_scale, (128, 128), _DTYPE)
    shape = f"T={num_tokens} N={n} K={k}"
    flops = 2 * num_tokens * n * k
    out_bytes = 2 * num_tokens * (n + k)

    zero = torch.randint(-2, 3, int4_scale.shape, device=device, dtype=torch.int8)

    def case(name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], weight_bytes: int,
             zero: torch.Tensor | None = None) -> _Case:
        def compare() -> _Error:
            return _compare((quant_linear(x, weight, scale, block, zero=zero),
                             quant_linear_ref(x, weight, scale, block, zero=zero)))

        return _Case(name, "llama-8b", shape, lambda: quant_linear(x, weight, scale, block, zero=zero), compare,
                     weight_bytes + out_bytes, flops)

    def compare_bf16() -> _Error:
        return _compare((torch.nn.functional.linear(x, bf16), quant_linear_ref(x, fp8, fp8_scale, (128, 128))))

    return [
        case("quant_linear fp8", fp8, fp8_scale, (128, 128), n * k),
        case("quant_linear int4", int4, int4_scale, (1, 128), n * k // 2),
        case("quant_linear int4 zeros", int4, int4_scale, (1, 128), n * k // 2 + zero.numel(), zero),
        _Case("bf16 F.linear", "llama-8b", shape, lambda: torch.nn.functional.linear(x, bf16), compare_bf16,
              2 * n * k + out_bytes, flops),
    ]  # fmt: skip


def _int4_groups(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] as int4 values in groups of 128 columns, packed eight to an int32 word (value
    j of a word in bits 4j, stored plus 8), and their scales [N, K / 128]."""
    n, k = dense.shape
    groups = dense.view(n, k // 128, 128)
    scale = groups.abs().amax(dim=-1) / 7
    q = (groups / scale[..., None]).round().clamp(-8, 7).view(n, k // 8, 8).long() + 8
    words = (q << torch.arange(0, 32, 4, device=dense.device)).sum(-1)  # below 2^32
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32), scale


def format_rows(rows: list[dict[str, object]]) -> str:
    """The rows as an aligned text table."""
    lines = [
        f"{'kernel':<20} {'config':<13} {'shape':<34} {'err':>8} {'ms':>8} {'GB/s':>7} "
        f"{'copy':>7} {'%copy':>6} {'TFLOP/s':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r['kernel']:<20} {r['config']:<13} {r['shape']:<34} {r['max_abs_err']:>8.1e} "
            f"{r['ms']:>8.4f} {r['gb_per_s']:>7.0f} {r['copy_gb_per_s']:>7.0f} "
            f"{r['pct_of_copy']:>5.0f}% {r['tflop_per_s']:>8.1f}"
            + ("" if r["ok"] else "  MISMATCH")
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_rows(check_kernels()))
