"""genq's Triton kernels, each with a launcher that checks its inputs and a torch reference.

Importing this package works without Triton (the references stay usable); launching a
kernel then raises a RuntimeError saying so. On a machine without a GPU, set
TRITON_INTERPRET=1 before importing this package to run the kernels on CPU tensors.
"""

from kernels._common import HAS_TRITON
from kernels.dtw import dtw_trace, dtw_trace_ref, warp_path
from kernels.fused_moe import fused_moe, fused_moe_ref, moe_align
from kernels.kv_cache import reshape_and_cache, reshape_and_cache_ref
from kernels.paged_attention import choose_num_splits, paged_attention, paged_attention_ref
from kernels.quant_linear import quant_linear, quant_linear_ref
from kernels.recurrent import (
    StateSaves,
    causal_conv1d_step,
    causal_conv1d_step_ref,
    gated_delta_scan,
    gated_delta_scan_ref,
)
from kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from kernels.rotary import apply_rotary_emb, apply_rotary_emb_ref, build_cos_sin_cache
from kernels.sampling import top_k_top_p_sample, top_k_top_p_sample_ref

__all__ = [
    "HAS_TRITON",
    "StateSaves",
    "apply_rotary_emb",
    "apply_rotary_emb_ref",
    "build_cos_sin_cache",
    "causal_conv1d_step",
    "causal_conv1d_step_ref",
    "choose_num_splits",
    "dtw_trace",
    "dtw_trace_ref",
    "quant_linear",
    "quant_linear_ref",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "fused_moe",
    "fused_moe_ref",
    "gated_delta_scan",
    "gated_delta_scan_ref",
    "moe_align",
    "paged_attention",
    "paged_attention_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "rms_norm",
    "rms_norm_ref",
    "top_k_top_p_sample",
    "top_k_top_p_sample_ref",
    "warp_path",
]
