"""Compile every kernel for a CUDA architecture without a GPU: `python -m kernels.compile_check`.

Triton's interpreter runs kernel bodies as numpy and accepts code the real compiler
rejects (loop-carried type changes, tl.dot shape or dtype rules, shared-memory overflow).
This lowers each kernel, in the variants the launchers use, all the way to a cubin with the
ptxas that ships with Triton, so a CPU-only machine still checks the GPU path compiles.
It must run in a process where TRITON_INTERPRET is unset.
"""

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

from kernels._common import HAS_TRITON, is_interpreted, padded_head_dim, tl
from kernels.fused_moe import _BLOCK_K, _BLOCK_M, _moe_matmul_kernel
from kernels.fused_moe import _BLOCK_N as _MOE_BLOCK_N
from kernels.kv_cache import _reshape_and_cache_kernel
from kernels.paged_attention import (
    _choose_tiling,
    _merge_splits_kernel,
    _paged_attention_kernel,
)
from kernels.quant_linear import _quant_linear_kernel, block_k, tiles
from kernels.recurrent import _BLOCK_C, _conv_step_kernel, _delta_scan_kernel
from kernels.rmsnorm import _rms_norm_kernel
from kernels.rotary import _rotary_kernel
from kernels.sampling import _top_k_top_p_sample_kernel

__all__ = ["CompileResult", "compile_all", "main"]

_FLOAT_ARGS = {"scale_log2", "eps"}
# Integer arguments that are multiples of 16 in real launches (models' head sizes are: 64, 96,
# 128, 256; token strides are multiples of them); the JIT specialises on that, so the check should too.
_DIVISIBLE_INTS = {
    "stride_logits", "stride_noise",
    "stride_q_tok", "stride_q_head", "stride_o_split", "stride_o_tok", "stride_o_head",
    "stride_cache_slot", "stride_k_tok", "stride_k_head", "stride_v_tok", "stride_v_head",
    "stride_p_split", "stride_p_tok", "stride_p_head",
    "stride_x", "stride_residual", "stride_out", "stride_residual_out",
    "stride_am", "stride_we", "stride_wn", "stride_om", "stride_xm",
}  # fmt: skip
_MOE_PTRS = {"sorted_ids_ptr": "*i64", "block_experts_ptr": "*i64"}
_SCAN_PTRS = {"slots_ptr": "*i64", "starts_ptr": "*i32", "save_index_ptr": "*i32", "save_after_ptr": "*i32",
              "save_slots_ptr": "*i64"}
_INT32_PTRS = {"query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32"}


@dataclass(frozen=True)
class _Variant:
    name: str
    kernel: Any  # a triton JITFunction
    ptr_dtype: str  # pointer type of the activations, e.g. "*bf16"
    constexprs: dict[str, Any]
    ptr_overrides: dict[str, str]
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class CompileResult:
    name: str
    shared_bytes: int
    num_warps: int


# the most shared memory one block may take, by compute capability (CUDA's guide)
MAX_SHARED_BYTES = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


def _signature(variant: _Variant) -> dict[str, str]:
    sig = {}
    for name in variant.kernel.arg_names:
        if name in variant.constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = variant.ptr_overrides.get(name, variant.ptr_dtype)
        else:
            sig[name] = "fp32" if name in _FLOAT_ARGS else "i32"
    return sig


def _divisibility(variant: _Variant) -> dict[tuple[int, ...], list[list[Any]]]:
    """Alignment hints as the JIT derives them at launch: 16-byte aligned pointers, 16 | ints."""
    names = variant.kernel.arg_names
    return {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(names)
        if name.endswith("_ptr") or name in _DIVISIBLE_INTS
    }


def _attention_variant(
    name: str, dtype: str, head_dim: int, group: int, max_query_len: int, split: bool, window: int = 0,
    softcap: float = 0.0, cache: str | None = None, sinks: bool = False, until: bool = False, chunk: int = 0,
) -> _Variant:
    """`cache`: the KV cache's pointer type when it is not the activations' (*fp8e4nv)."""
    element_size = {"*fp16": 2, "*bf16": 2, "*fp32": 4}[dtype]
    tiling = _choose_tiling(group, max_query_len, padded_head_dim(head_dim), element_size)
    dot = {"*fp16": tl.float16, "*bf16": tl.bfloat16, "*fp32": tl.float32}[dtype]
    overrides = dict(_INT32_PTRS, lse_ptr="*fp32", sinks_ptr="*fp32", until_ptr="*i32")
    if cache:
        overrides.update(k_cache_ptr=cache, v_cache_ptr=cache)
    if split:
        overrides["out_ptr"] = "*fp32"
    constexprs = dict(
        GROUP=group, HEADS_P=tiling.heads_p, HEAD_TILES=tiling.head_tiles, BLOCK_Q=tiling.block_q,
        BLOCK_M=tiling.block_m,
        BLOCK_N=tiling.block_n, BLOCK_SIZE=16, HEAD_DIM=head_dim, HEAD_P=padded_head_dim(head_dim), DOT_DTYPE=dot,
        DOT_PRECISION="ieee" if dtype == "*fp32" else "tf32", SPLIT=split, WINDOW=window, CHUNK=chunk,
        SOFTCAP=softcap, SINKS=sinks, UNTIL=until,
    )  # fmt: skip
    kernel = _paged_attention_kernel
    return _Variant(name, kernel, dtype, constexprs, overrides, tiling.num_warps, tiling.num_stages)


def _moe_variant(name: str, dtype: str, first: bool, weights: str, quantized: tuple[str, tuple[int, int]] | None = None,
                 zero: bool = False) -> _Variant:
    """One of fused_moe's two launches: gate/up over tokens, or down over pairs scaled by
    routing weights of dtype `weights` (fp32 for Mixtral, whose weighted rows stay fp32);
    with `quantized` (the experts' pointer type, *i32 for packed int4, and the scale block),
    over quantized experts, with `zero`, less their zero points."""
    dot = {"*fp16": tl.float16, "*bf16": tl.bfloat16, "*fp32": tl.float32}[dtype]
    block = quantized[1] if quantized else (1, 1)
    fp4 = quantized is not None and quantized[0] == "fp4"  # e2m1 codes, read as int4 words
    if fp4:
        quantized = ("*i32", block)
    constexprs = dict(
        NUM_EXPERTS=64, TOP_K=8, A_PER_TOKEN=first, MUL_WEIGHT=not first, DOT_DTYPE=dot,
        DOT_PRECISION="ieee" if dtype == "*fp32" else "tf32", SCALED=quantized is not None,
        INT4=quantized is not None and quantized[0] == "*i32", FP4=fp4, E8M0=fp4, HAS_ZERO=zero, SCALE_ROWS=block[0],
        SCALE_COLS=block[1],
        BLOCK_M=_BLOCK_M, BLOCK_N=_MOE_BLOCK_N, BLOCK_K=block_k(block[1], 2048) if quantized else _BLOCK_K,
    )  # fmt: skip
    overrides = dict(_MOE_PTRS, topk_weights_ptr=weights)
    overrides["w_ptr"] = quantized[0] if quantized else dtype
    overrides["scale_ptr"] = "*u8" if fp4 else "*fp32" if quantized else overrides["w_ptr"]
    overrides["zero_ptr"] = "*i8" if zero else overrides["w_ptr"]
    if not first:
        overrides["out_ptr"] = weights
    return _Variant(name, _moe_matmul_kernel, dtype, constexprs, overrides)


def _quant_variant(name: str, rows: int, block: tuple[int, int], weight: str = "*fp8e4nv", k: int = 4096,
                   zero: bool = False) -> _Variant:
    """quant_linear as the launcher tiles `rows` rows of bf16 activations, over weights of
    pointer type `weight` (*i32: packed int4), with `zero`, less their zero points."""
    block_m, block_n = tiles(rows)
    constexprs = dict(
        SCALE_ROWS=block[0], SCALE_COLS=block[1], INT4=weight == "*i32", HAS_ZERO=zero, HAS_BIAS=False,
        DOT_DTYPE=tl.bfloat16,
        DOT_PRECISION="tf32", BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k(block[1], k),
    )  # fmt: skip
    overrides = dict(w_ptr=weight, scale_ptr="*fp32", zero_ptr="*i8" if zero else "*fp32", bias_ptr=weight)
    return _Variant(name, _quant_linear_kernel, "*bf16", constexprs, overrides)


def _variants() -> list[_Variant]:
    return [
        _attention_variant("attention fp16 d128 gqa4 decode split", "*fp16", 128, 4, 1, True),
        _attention_variant("attention bf16 d64 gqa3 prefill", "*bf16", 64, 3, 512, False),
        _attention_variant("attention bf16 d128 gqa4 prefill", "*bf16", 128, 4, 512, False),
        _attention_variant("attention fp32 d64 mha prefill", "*fp32", 64, 1, 512, False),
        _attention_variant("attention bf16 d128 gqa4 window decode", "*bf16", 128, 4, 1, True, window=4096),
        _attention_variant("attention bf16 d256 gqa2 softcap prefill", "*bf16", 256, 2, 512, False, window=4096,
                           softcap=50.0),
        _attention_variant("attention bf16 d128 gqa4 fp8 cache decode split", "*bf16", 128, 4, 1, True,
                           cache="*fp8e4nv"),
        _attention_variant("attention bf16 d128 gqa4 fp8 cache prefill", "*bf16", 128, 4, 512, False,
                           cache="*fp8e4nv"),
        # GPT-OSS: a sink per head, 8 query heads per KV head, windows of 128 on every other layer
        _attention_variant("attention bf16 d64 gqa8 sinks window decode split", "*bf16", 64, 8, 1, True,
                           window=128, sinks=True),
        _attention_variant("attention bf16 d64 gqa8 sinks prefill", "*bf16", 64, 8, 512, False, sinks=True),
        # Gemma 3 with images: image tokens see their whole image (attend_until), windows of 1024
        _attention_variant("attention bf16 d256 gqa2 window until prefill", "*bf16", 256, 2, 512, False, window=1024,
                           until=True),
        # Phi-3's 96-wide heads, in 128-wide tiles
        _attention_variant("attention bf16 d96 mha prefill", "*bf16", 96, 1, 512, False),
        # Llama 4 Scout's chunked layers: 40 query heads over 8 KV heads, chunks of 8192
        _attention_variant("attention bf16 d128 gqa5 chunk prefill", "*bf16", 128, 5, 512, False, chunk=8192),
        _attention_variant("attention bf16 d128 gqa5 chunk decode split", "*bf16", 128, 5, 1, True, chunk=8192),
        _attention_variant("attention bf16 d96 mha decode split", "*bf16", 96, 1, 1, True, window=2047),
        # DeepSeek-V3's latent attention: one cache head of 512 + 64 columns (1024-wide tiles)
        _attention_variant("attention bf16 d576 gqa16 MLA decode split", "*bf16", 576, 16, 1, True),
        _attention_variant("attention bf16 d576 gqa128 MLA prefill", "*bf16", 576, 128, 512, False),
        _attention_variant("attention fp32 d576 gqa9 MLA prefill", "*fp32", 576, 9, 512, False),
        _Variant(
            "merge splits bf16 d128", _merge_splits_kernel, "*fp32",
            dict(SPLITS_P=8, BLOCK_H=32, HEAD_DIM=128, HEAD_P=128),
            dict(out_ptr="*bf16", query_start_loc_ptr="*i32"),
        ),
        _Variant(
            "merge splits bf16 d96", _merge_splits_kernel, "*fp32",
            dict(SPLITS_P=8, BLOCK_H=32, HEAD_DIM=96, HEAD_P=128),
            dict(out_ptr="*bf16", query_start_loc_ptr="*i32"),
        ),
        _Variant(
            "reshape_and_cache bf16 8x128", _reshape_and_cache_kernel, "*bf16",
            dict(NUM_KV_HEADS=8, HEADS_P=8, HEAD_DIM=128, HEAD_P=128, FP8=False), dict(slot_mapping_ptr="*i64"),
        ),
        _Variant(
            "reshape_and_cache bf16 32x96", _reshape_and_cache_kernel, "*bf16",
            dict(NUM_KV_HEADS=32, HEADS_P=32, HEAD_DIM=96, HEAD_P=128, FP8=False), dict(slot_mapping_ptr="*i64"),
        ),
        _Variant(
            "reshape_and_cache bf16 into fp8", _reshape_and_cache_kernel, "*bf16",
            dict(NUM_KV_HEADS=8, HEADS_P=8, HEAD_DIM=128, HEAD_P=128, FP8=True),
            dict(slot_mapping_ptr="*i64", k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv"),
        ),
        _Variant(
            "fused_add_rms_norm bf16 576", _rms_norm_kernel, "*bf16",
            dict(HIDDEN=576, BLOCK=1024, ROWS=2, HAS_RESIDUAL=True), {}, num_warps=8,
        ),
        _Variant(
            "rotary bf16 32/8 heads d128", _rotary_kernel, "*bf16",
            dict(HEADS_P=32, KV_HEADS_P=8, HALF=64, HALF_P=64, TOKENS=1),
            dict(positions_ptr="*i64", cos_sin_ptr="*fp32"),
        ),
        _Variant(  # Phi-3's 96-wide heads; and Phi-4-mini's first 96 columns of 128
            "rotary bf16 24/8 heads, 96 rotated", _rotary_kernel, "*bf16",
            dict(HEADS_P=32, KV_HEADS_P=8, HALF=48, HALF_P=64, TOKENS=1),
            dict(positions_ptr="*i64", cos_sin_ptr="*fp32"),
        ),
        _Variant(  # SmolLM2's 9/3 heads of 64: four tokens a program
            "rotary bf16 9/3 heads d64", _rotary_kernel, "*bf16",
            dict(HEADS_P=16, KV_HEADS_P=4, HALF=32, HALF_P=32, TOKENS=4),
            dict(positions_ptr="*i64", cos_sin_ptr="*fp32"),
        ),
        _Variant(
            "top_k_top_p_sample bf16", _top_k_top_p_sample_kernel, "*bf16",
            dict(BLOCK_V=2048),
            dict(noise_ptr="*fp32", top_k_ptr="*i32", top_p_ptr="*fp32", out_ptr="*i64"),
            num_warps=8,
        ),
        # the decode steps of Qwen3.5's Gated DeltaNet (heads of 128 by 128) and Mamba2's (64 over 128)
        _Variant(
            "causal_conv1d_step bf16 kernel 4", _conv_step_kernel, "*bf16",
            dict(KERNEL=4, BLOCK_C=_BLOCK_C, HAS_BIAS=True), dict(slots_ptr="*i64"),
        ),
        _Variant(
            "gated_delta_scan fp32 128x128, saves", _delta_scan_kernel, "*fp32",
            dict(KEY_DIM=128, VALUE_DIM=128, KEY_P=128, BLOCK_V=64, DELTA=True, SAVES=True), _SCAN_PTRS,
        ),
        _Variant(
            "gated_delta_scan fp32 128x64, no delta", _delta_scan_kernel, "*fp32",
            dict(KEY_DIM=128, VALUE_DIM=64, KEY_P=128, BLOCK_V=64, DELTA=False, SAVES=False), _SCAN_PTRS,
        ),
        _moe_variant("fused_moe gate_up bf16 64x8", "*bf16", first=True, weights="*bf16"),
        _moe_variant("fused_moe down bf16 64x8", "*bf16", first=False, weights="*bf16"),
        _moe_variant("fused_moe down bf16, fp32 weights", "*bf16", first=False, weights="*fp32"),
        _moe_variant("fused_moe gate_up bf16, fp8 experts", "*bf16", first=True, weights="*bf16",
                     quantized=("*fp8e4nv", (128, 128))),
        _moe_variant("fused_moe down bf16, fp8 experts", "*bf16", first=False, weights="*bf16",
                     quantized=("*fp8e4nv", (128, 128))),
        _moe_variant("fused_moe gate_up bf16, int4 experts", "*bf16", first=True, weights="*bf16",
                     quantized=("*i32", (1, 128))),
        _moe_variant("fused_moe down bf16, int4 experts - zeros", "*bf16", first=False, weights="*bf16",
                     quantized=("*i32", (1, 128)), zero=True),
        _moe_variant("fused_moe down bf16, int8 experts", "*bf16", first=False, weights="*bf16",
                     quantized=("*i8", (1, 2048))),
        _moe_variant("fused_moe gate_up bf16, MXFP4 experts", "*bf16", first=True, weights="*bf16",
                     quantized=("fp4", (1, 32))),
        _moe_variant("fused_moe down bf16, MXFP4 experts", "*bf16", first=False, weights="*bf16",
                     quantized=("fp4", (1, 32))),
        _quant_variant("quant_linear fp8 decode, 128x128 blocks", 8, (128, 128)),
        _quant_variant("quant_linear fp8 prefill, 128x128 blocks", 2048, (128, 128)),
        _quant_variant("quant_linear fp8 decode, per channel", 8, (1, 4096)),
        _quant_variant("quant_linear int8 decode, per channel", 8, (1, 4096), "*i8"),
        _quant_variant("quant_linear int4 decode, groups of 128", 8, (1, 128), "*i32"),
        _quant_variant("quant_linear int4 prefill, groups of 128", 2048, (1, 128), "*i32"),
        _quant_variant("quant_linear int4 decode, AWQ zeros", 8, (1, 128), "*i32", zero=True),
        _quant_variant("quant_linear int8 prefill, GPTQ zeros", 2048, (1, 128), "*i8", zero=True),
    ]  # fmt: skip


def compile_all(arch: int = 90, jobs: int = 1) -> list[CompileResult]:
    """Compile each kernel variant to a cubin for sm_`arch`, `jobs` at a time (in forked
    processes); raises on the first failure."""
    if not HAS_TRITON:
        raise RuntimeError("compile_check needs Triton")
    if any(is_interpreted(variant.kernel) for variant in _variants()):
        raise RuntimeError("compile_check must run with TRITON_INTERPRET unset")
    indices = range(len(_variants()))
    if jobs <= 1:
        return [_compile(i, arch) for i in indices]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_compile, indices, [arch] * len(indices)))


def _compile(index: int, arch: int) -> CompileResult:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    variant = _variants()[index]
    src = ASTSource(variant.kernel, _signature(variant), variant.constexprs, _divisibility(variant))
    options = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    limit = MAX_SHARED_BYTES.get(arch)
    if limit is not None and compiled.metadata.shared > limit:  # (the GPU refuses it at launch)
        raise RuntimeError(f"{variant.name}: takes {compiled.metadata.shared} bytes of shared memory, "
                           f"more than sm_{arch}'s {limit}")
    return CompileResult(variant.name, compiled.metadata.shared, variant.num_warps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="variants compiled at once")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET to compile for CUDA", file=sys.stderr)
        return 2
    for result in compile_all(args.arch, args.jobs):
        print(f"ok  {result.name:<40} shared {result.shared_bytes:>6} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
