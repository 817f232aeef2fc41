"""The Llama-lineage decoder over a flat batch and a paged KV cache: Llama, Mistral, Qwen,
Phi-3, Gemma, Granite, OLMo, SmolLM3, GLM-4, gpt-oss and their kin, mixtures of experts
included, each a set of ModelConfig fields this one layer reads (worker/model_executor/models/config.py
lists the architectures).

Weights are read from a Hugging Face checkpoint; q/k/v and gate/up projections are fused at
load time so each layer makes two matmuls for attention input and MLP input instead of five.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from worker.model_executor.attention import FP8, apply_softcap
from worker.model_executor.models import gpt_oss, kv_scales, quant
from worker.model_executor.models.config import ModelConfig
from worker.model_executor.models.linear_attention import (
    GatedDeltaNet,
    GatedRMSNorm,
    Mamba2Mixer,
    grouped_projections,
)
from worker.model_executor.models.logits_buffer import LogitsBuffer
from worker.model_executor.models.mla import MLAttention
from worker.model_executor.models.moe import SparseMoeBlock

if TYPE_CHECKING:
    from worker.model_executor.lora_slots import LoRAMapping, LoRASlots


class RMSNorm(nn.Module):
    """RMSNorm, optionally preceded by the residual add: `norm(x)` returns rms_norm(x);
    `norm(x, residual)` returns (rms_norm(x + residual), x + residual), the sum being the
    next residual. With `use_kernel` one Triton kernel does both (the CUDA path)."""

    def __init__(self, hidden_size: int, eps: float, use_kernel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_kernel = use_kernel
        self.cpu_fused = False  # bf16 on the CPU: genq_cpu adds and normalises in one pass (fuse_small_ops)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None  # [T, hidden] each
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.use_kernel:
            return self._forward_kernel(x, residual)
        if residual is None:
            return self._norm(x)
        if (self.cpu_fused and x.dtype == self.weight.dtype == torch.bfloat16 and x.is_contiguous()
                and residual.is_contiguous()):
            from kernels.cpu import add_rms_norm_

            # over x and residual, in place: both are this step's own activations, dead after the call
            add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        x = x + residual  # rounded to the activation dtype before the norm, as in transformers
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers (normalise in float32, cast, then scale), with
        # torch's fused kernel for the normalisation: bitwise equal, fewer passes.
        return self.scaled(F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps), x.dtype)

    def scaled(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weight applied to a float32 normalised value, in `dtype`."""
        return self.weight * normed.to(dtype)

    def _forward_kernel(self, x, residual):
        import kernels  # triton is loaded only where the kernel path runs

        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        # over x and residual: both are this step's own activations, dead after the call
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps, inplace=True)


class Float32ScaleRMSNorm(RMSNorm):
    """The RMSNorm of Gemma (weight offset 1) and OLMo 2 (offset 0): `offset + weight` scales
    the float32 normalised value before it is rounded (Llama rounds first). Torch ops on
    every device."""

    def __init__(self, hidden_size: int, eps: float, offset: float):
        super().__init__(hidden_size, eps, use_kernel=False)
        self.offset = offset

    def scaled(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (normed * (self.offset + self.weight.float())).to(dtype)


def fuse_small_ops(model: nn.Module) -> int:
    """Let genq_cpu's fused kernels run a bf16 model's small ops on the CPU (the "cpu" attention
    backend): each residual add with its RMSNorm, SiLU(gate) * up, the rotary rotation (each
    module still takes its torch path for what the kernels do not cover). How many modules."""
    fused = [m for m in model.modules() if type(m) in (RMSNorm, MLP, RotaryEmbedding)]
    for module in fused:
        setattr(module, "cpu_fused", True)  # noqa: B010 - (nn.Module's __setattr__ types its values as tensors and modules)
    return len(fused)


def make_norm(cfg: ModelConfig, hidden_size: int, use_kernel: bool = False) -> RMSNorm:
    if cfg.norm_weight_offset is not None:
        return Float32ScaleRMSNorm(hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)
    return RMSNorm(hidden_size, cfg.rms_norm_eps, use_kernel)


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary tables for every position, built once; `for_step` gives the
    rotation of one step's q and k heads. With `use_kernel` a Triton kernel rotates them in
    place from one float32 cos|sin table (the CUDA path).

    `mrope_section` (M-RoPE, Qwen2-VL and Qwen2.5-VL): the rotary pairs in sections, each
    rotated by one of three position streams (temporal, height, width); `interleaved`
    (Qwen3-VL): pairs 3i + 1 and 3i + 2 rotate by the height and width streams while i is
    under their sections' sizes, the others by the temporal one. A step whose positions are
    [3, T] rotates each column by its stream, one of [T] by that position alone."""

    cos: torch.Tensor  # [max_positions, rotary_dim] float32, torch path
    sin: torch.Tensor
    cos_sin: torch.Tensor  # [max_positions, rotary_dim] float32: cos | sin, kernel path
    streams: torch.Tensor  # [rotary_dim]: each column's position stream, with mrope_section

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int,
                 use_kernel: bool = False, mrope_section: tuple[int, ...] | None = None, interleaved: bool = False):
        super().__init__()
        self.use_kernel = use_kernel
        self.cpu_fused = False  # bf16 on the CPU: genq_cpu's kernel rotates in place (fuse_small_ops)
        self.mrope = mrope_section is not None
        if mrope_section is not None:
            half = _mrope_streams(mrope_section, len(inv_freq), interleaved)
            self.register_buffer("streams", torch.cat((half, half)), persistent=False)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())  # [max_positions, rotary_dim / 2]
        if use_kernel:
            cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_scaling
            self.register_buffer("cos_sin", cos_sin, persistent=False)  # [max_positions, rotary_dim]
            return
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rotary_dim]
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:  # positions: [T], or [3, T]
        if positions.dim() == 2:
            return self._sections(positions, dtype)
        if self.use_kernel:
            return KernelRope(positions, self.cos_sin)
        # cos and sin gathered once for all layers: [T, 1, rotary_dim] each
        rope = CpuRope if self.cpu_fused and dtype == torch.bfloat16 else TableRope
        return rope(self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1))

    def _sections(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """M-RoPE: each column's table entry at its own stream's position."""
        assert self.mrope, "positions in three streams need mrope_section"
        at = positions[self.streams].T  # [T, rotary_dim]: the position each column rotates by
        columns = torch.arange(at.shape[1], device=at.device)
        if self.use_kernel:  # the step's own rows of the table, read in order
            rows = self.cos_sin[at, columns].contiguous()  # [T, rotary_dim]
            return KernelRope(torch.arange(len(rows), device=rows.device), rows)
        return TableRope(self.cos[at, columns].to(dtype).unsqueeze(1), self.sin[at, columns].to(dtype).unsqueeze(1))


def _mrope_streams(section: tuple[int, ...], pairs: int, interleaved: bool) -> torch.Tensor:  # [pairs]
    """Each rotary pair's position stream (0: temporal, 1: height, 2: width)."""
    if sum(section) != pairs:
        raise ValueError(f"mrope_section {list(section)} covers {sum(section)} rotary pairs; the heads have {pairs}")
    if not interleaved:
        return torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section))
    streams = torch.zeros(pairs, dtype=torch.long)
    for stream in (1, 2):
        streams[stream : section[stream] * 3 : 3] = stream
    return streams


class Rope(Protocol):
    def __call__(self, qk: torch.Tensor, num_heads: int) -> torch.Tensor:
        """qk: [T, num_heads + num_kv_heads, head_dim], q heads first; returns it rotated."""


@dataclass
class TableRope:
    cos: torch.Tensor  # [T, 1, rotary_dim] in the activation dtype
    sin: torch.Tensor

    def __call__(self, qk: torch.Tensor, num_heads: int) -> torch.Tensor:
        rotary_dim = self.cos.shape[-1]
        if rotary_dim < qk.shape[-1]:  # partial rotary: the rest of each head passes through
            return torch.cat((self._rotate(qk[..., :rotary_dim]), qk[..., rotary_dim:]), dim=-1)
        return self._rotate(qk)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        # q and k heads in one pass, rounding each product as transformers does
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * self.cos + rotated * self.sin


class CpuRope(TableRope):
    """The table's rotation by genq_cpu's kernel, in place on the step's q and k heads (bf16,
    whole heads rotated, each token's heads contiguous); otherwise as TableRope."""

    def __call__(self, qk: torch.Tensor, num_heads: int) -> torch.Tensor:
        if qk.shape[-1] != self.cos.shape[-1] or qk.dtype != torch.bfloat16 or qk.stride(1) != qk.shape[-1] \
                or qk.stride(2) != 1:
            return super().__call__(qk, num_heads)
        from kernels.cpu import rope_

        rope_(qk, self.cos, self.sin)
        return qk  # rotated in place


def no_rope(qk: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A layer without positional rotation (SmolLM3's NoPE layers): q and k as they are."""
    return qk


@dataclass
class ScaledQueries:
    """A rotation, then each token's queries scaled (Llama 4's attention temperature)."""

    rope: Rope
    scale: torch.Tensor  # [T], in the activation dtype or float32 (QueryScale.rounded)

    def __call__(self, qk: torch.Tensor, num_heads: int) -> torch.Tensor:
        qk = self.rope(qk, num_heads)
        qk[:, :num_heads] *= self.scale[:, None, None]  # a float32 scale: the product rounded once
        return qk


@dataclass
class UnitNormed:
    """A rotation, then each q and k head scaled to unit RMS, in float32 (Llama 4's q/k norm,
    which has no weight, on its rotated layers)."""

    rope: Rope
    eps: float

    def __call__(self, qk: torch.Tensor, num_heads: int) -> torch.Tensor:
        x = self.rope(qk, num_heads).float()
        return (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)).to(qk.dtype)


@dataclass
class KernelRope:
    positions: torch.Tensor  # [T]
    cos_sin: torch.Tensor  # [max_positions, rotary_dim] float32: cos | sin

    def __call__(self, qk: torch.Tensor, num_heads: int) -> torch.Tensor:
        import kernels

        rotary_dim = self.cos_sin.shape[-1]  # partial rotary: each head's leading columns only
        kernels.apply_rotary_emb(self.positions, qk[:, :num_heads, :rotary_dim], qk[:, num_heads:, :rotary_dim],
                                 self.cos_sin)
        return qk  # rotated in place


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.span = cfg.layer_span(index)  # what its queries see: a sliding window, their chunk, or all
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.output_gate = cfg.attn_output_gate  # q_proj's rows: each head's queries, then its gate
        q_rows = self.q_size * (2 if self.output_gate else 1)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_rows + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.scale = cfg.attn_scale or self.head_dim**-0.5
        self.softcap = cfg.attn_softcap
        if cfg.qk_norm:  # torch ops on every device: a [T, heads, head_dim] norm is small
            whole = cfg.qk_norm_whole  # OLMo 2: over all heads of q (of k) at once
            self.q_norm = make_norm(cfg, self.q_size if whole else self.head_dim)
            self.k_norm = make_norm(cfg, self.kv_size if whole else self.head_dim)
        self.qk_norm = cfg.qk_norm
        self.qk_norm_whole = cfg.qk_norm_whole
        self.qkv_lora: LoRASlots | None = None  # adapter slots, where LoRA is enabled
        self.o_lora: LoRASlots | None = None
        # gpt-oss: a logit per query head that joins its softmax (and adds no value)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attn_sinks else None
        self.kv_scales: kv_scales.KVScales | None = None  # the checkpoint's, for an fp8 cache
        # tensor parallelism: sums o_proj's partial outputs over the ranks (worker.model_executor.tensor_parallel), of
        # which there are `world_size`
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.world_size = 1

    def _split_norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo 2's q and k norms over whole projections whose heads the ranks share: each
        rank's sums of squares, summed by one all-reduce, over every rank's columns (a KV head
        that several ranks keep is counted as often in the sum as in the columns)."""
        assert self.reduce is not None
        sums = self.reduce(torch.stack((q.float().square().sum(-1), k.float().square().sum(-1)), dim=-1))  # [T, 2]
        q_norm, k_norm = (norm.scaled(x.float() * torch.rsqrt(total[:, None] / (x.shape[-1] * self.world_size)
                                                              + norm.eps), x.dtype)
                          for x, norm, total in ((q, self.q_norm, sums[:, 0]), (k, self.k_norm, sums[:, 1])))
        return q_norm, k_norm

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: Rope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: Any,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.add(qkv, x, self.qkv_lora)
        gate = None
        if self.output_gate:
            q_gate, kv = qkv.split([2 * self.q_size, 2 * self.kv_size], dim=-1)
            q, gate = q_gate.view(num_tokens, self.num_heads, 2, self.head_dim).unbind(2)
            qkv = torch.cat((q.reshape(num_tokens, self.q_size), kv), dim=-1)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole:
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            qk = torch.cat(self._split_norms(q, k) if self.reduce else (self.q_norm(q), self.k_norm(k)), dim=-1)
        qk = qk.view(num_tokens, -1, self.head_dim)
        if self.qk_norm and not self.qk_norm_whole:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # q and k heads rotated in one pass: [T, num_heads + num_kv_heads, D]
        qk = rope(qk, self.num_heads)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        scales, scale = self.kv_scales if kv_cache[0].dtype == FP8 else None, self.scale
        if scales is not None:
            q, k, v, scale = scales.into_cache(q, k, v, scale)
        o = meta.forward(q, k, v, kv_cache, scale, self.span, self.softcap, self.sinks)
        if scales is not None:
            o = scales.out_of_cache(o)
        o = o.view(num_tokens, self.q_size)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(num_tokens, self.q_size))
        out = self.o_proj(o) if lora is None else lora.add(self.o_proj(o), o, self.o_lora)
        return out if self.reduce is None else self.reduce(out)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, act: str = "silu"):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.act = act  # silu, gelu, or gelu_pytorch_tanh
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.cpu_fused = False  # bf16 on the CPU: genq_cpu's SiLU(gate) * up in one pass (fuse_small_ops)
        self.gate_up_lora: LoRASlots | None = None  # adapter slots, where LoRA is enabled
        self.down_lora: LoRASlots | None = None
        # tensor parallelism: sums down_proj's partial outputs over the ranks (worker.model_executor.tensor_parallel)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:  # [T, hidden]
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.add(gate_up, x, self.gate_up_lora)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        # in place on the projection's own output: no extra [T, intermediate] buffers
        if self.act == "silu" and self.cpu_fused and gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous():
            from kernels.cpu import silu_and_mul

            h = silu_and_mul(gate_up)
        elif self.act == "silu":
            h = F.silu(gate, inplace=True).mul_(up)
        else:
            h = F.gelu(gate, approximate="tanh" if self.act == "gelu_pytorch_tanh" else "none").mul_(up)
        out = self.down_proj(h) if lora is None else lora.add(self.down_proj(h), h, self.down_lora)
        return out if self.reduce is None else self.reduce(out)


class ReluSquaredMLP(nn.Module):
    """Nemotron-H's MLP: up, ReLU squared, down; no gate."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.up = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.up_lora: LoRASlots | None = None  # adapter slots, where LoRA is enabled
        self.down_lora: LoRASlots | None = None

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:  # [T, hidden]
        up = self.up(x)
        if lora is not None:
            lora.add(up, x, self.up_lora)
        h = F.relu(up).square_()
        out = self.down(h) if lora is None else lora.add(self.down(h), h, self.down_lora)
        return out if self.reduce is None else self.reduce(out)


def state_mixer(cfg: ModelConfig, index: int, use_kernels: bool) -> GatedDeltaNet | Mamba2Mixer:
    """Layer `index`'s mixer with a per-request state: Mamba2, or Gated DeltaNet."""
    assert cfg.linear is not None
    mixer = Mamba2Mixer if cfg.linear.mamba2 else GatedDeltaNet
    return mixer(cfg.linear, cfg.hidden_size, cfg.rms_norm_eps, sorted(cfg.linear_layers).index(index), use_kernels)


class DecoderLayer(nn.Module):
    self_attn: Attention | MLAttention | GatedDeltaNet | Mamba2Mixer
    mlp: MLP | SparseMoeBlock | ReluSquaredMLP

    def __init__(self, cfg: ModelConfig, use_kernels: bool, index: int):
        super().__init__()
        self.one_part = cfg.one_part_layers
        if self.one_part:  # Nemotron-H: the layer is its mixer alone, or its MLP alone
            self._init_one_part(cfg, use_kernels, index)
            return
        if cfg.mla is not None:
            self.self_attn = MLAttention(cfg, make_norm)
        elif index in cfg.linear_layers:  # its checkpoint's linear_attn (Granite 4.0's mamba)
            self.self_attn = state_mixer(cfg, index, use_kernels)
        else:
            self.self_attn = Attention(cfg, index)
        if cfg.moe is not None and index in cfg.moe.layers:
            self.mlp = SparseMoeBlock(cfg.moe, cfg.hidden_size, use_kernels, MLP)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, use_kernels)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, use_kernels)
        self.sandwich = cfg.sandwich_norms
        self.post_norms_only = cfg.post_norms_only
        if cfg.post_norms_only:  # OLMo 2: attention and the MLP read the residual stream itself
            del self.input_layernorm
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, use_kernels)
        self.residual_scale = cfg.residual_scale
        if cfg.sandwich_norms:  # Gemma2: post_attention_layernorm normalises attention's output alone
            self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, use_kernels)
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, use_kernels)

    def _init_one_part(self, cfg: ModelConfig, use_kernels: bool, index: int) -> None:
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, use_kernels)
        experts = cfg.moe is not None and index in cfg.moe.layers  # (Nemotron 3's)
        self.mlp_only = index in cfg.mlp_only_layers or experts
        if experts:
            assert cfg.moe is not None
            self.mlp = SparseMoeBlock(cfg.moe, cfg.hidden_size, use_kernels, ReluSquaredMLP)
        elif self.mlp_only:
            self.mlp = ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        elif index in cfg.linear_layers:
            self.self_attn = state_mixer(cfg, index, use_kernels)
        else:
            self.self_attn = Attention(cfg, index)

    def forward(self, x, residual, rope, kv_cache, meta, lora=None):  # x, residual: [T, hidden]
        """The residual stream is carried beside x and added in by the next norm, so a
        kernel can fuse each add with the norm after it; residual is None at the first layer."""
        if self.one_part:
            x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
            return (self.mlp(x, lora) if self.mlp_only else self.self_attn(x, rope, kv_cache, meta, lora)), residual
        if self.post_norms_only:
            h = x if residual is None else x + residual
            h = h + self.post_attention_layernorm(self.self_attn(h, rope, kv_cache, meta, lora))
            return self.post_feedforward_layernorm(self.mlp(h, lora)), h
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta, lora)
        if self.residual_scale is not None:  # Granite scales each branch before its residual add
            x = x * self.residual_scale
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x, lora) * self.residual_scale, residual
        if not self.sandwich:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x, lora), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x, lora)), residual


class LlamaForCausalLM(nn.Module):
    """`use_kernels`: norms and rotary in Triton kernels (the CUDA path), else torch ops."""

    def __init__(self, cfg: ModelConfig, use_kernels: bool = False):
        super().__init__()
        self.config = cfg
        self.use_kernels = use_kernels
        # its weight made empty: on the meta device, nn.Embedding's own init would import torch._dynamo (1 s)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, use_kernels, i) for i in range(cfg.num_hidden_layers))
        self.norm = make_norm(cfg, cfg.hidden_size, use_kernels)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.labels:  # a classifier: the score head reads the last token's hidden state
            self.score = nn.Linear(cfg.hidden_size, len(cfg.labels), bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary: RotaryEmbedding
        self.rotary_local: RotaryEmbedding | None = None  # the windowed layers', where they have their own
        self.build_rotary(torch.device("cpu"))
        # an EAGLE-3 head reads the residual stream before these layers: each forward keeps
        # them, concatenated, in `aux` ([T, len(aux_layers) x hidden])
        self.aux_layers: tuple[int, ...] = ()
        self.aux: torch.Tensor | None = None
        self.logits_buffer = LogitsBuffer()

    def reduce_with(self, all_reduce: Callable[[torch.Tensor], torch.Tensor], world_size: int, rank: int) -> None:
        """Tensor parallelism: each layer's attention and MLP outputs are summed over the
        `world_size` ranks by `all_reduce` (the model holds rank `rank`'s share of them)."""
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            if hasattr(layer, "self_attn"):  # (Nemotron-H's one-part layers have it or an MLP)
                layer.self_attn.reduce = all_reduce  # attention's, or a layer with a state's
                layer.self_attn.world_size = world_size
            if hasattr(layer, "mlp"):
                layer.mlp.reduce = all_reduce  # a dense MLP's, or the whole expert block's
                if isinstance(layer.mlp, SparseMoeBlock):  # (with expert parallelism, its experts' ids)
                    layer.mlp.experts.first_expert = rank * layer.mlp.moe.num_local_experts

    def build_rotary(self, device: torch.device) -> None:
        """The rotary tables, computed (again) on `device`: after a model built on "meta" or cast
        to another dtype, as they stay float32 (each step rounds its rows to the model dtype)."""
        cfg = self.config
        with torch.device("cpu"):
            tables = [RotaryEmbedding(*cfg.rope_inv_freq(kind), cfg.max_position_embeddings, self.use_kernels,
                                      cfg.mrope_section, cfg.mrope_interleaved)
                      for kind in (("full_attention", "sliding_attention") if cfg.local_rope else ("full_attention",))]
        self.rotary = tables[0].to(device)
        self.rotary_local = tables[1].to(device) if cfg.local_rope else None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]; [3, T] for M-RoPE's streams (images in Qwen-VL prompts)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: Any,
        lora: LoRAMapping | None = None,  # the rows' adapters, if any request has one
        # rows [k] that take image embeddings, and those: [k, hidden], or [k, 1 + d, hidden] with
        # Qwen3-VL's deepstack, whose d more are added to the hidden states after layers 0 to d - 1
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_tokens(input_ids)
        # the scale rounded to the model's dtype, as transformers does for Gemma
        scale = None if self.config.embed_scale is None else torch.tensor(self.config.embed_scale, dtype=x.dtype)
        if scale is not None and not self.config.embed_scale_given:
            x = x * scale
        deepstack = None
        if images is not None:  # in place of their placeholder tokens' (after any scale, as transformers puts them)
            rows, embeds = images[0], images[1].to(x.dtype)
            if embeds.dim() == 3:
                embeds, deepstack = embeds[:, 0], embeds[:, 1:]
            x = x.index_copy(0, rows, embeds)
        if scale is not None and self.config.embed_scale_given:
            x = x * scale
        return self.decode(x, positions, kv_caches, meta, lora, None if deepstack is None else (rows, deepstack))

    def decode(
        self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any,
        lora: LoRAMapping | None = None, deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """The decoder layers and the final norm over the rows' input states `x` [T, hidden]."""
        residual = None
        ropes = self._layer_ropes(positions, x.dtype)
        aux: dict[int, torch.Tensor] = {}
        for i, (layer, kv_cache, layer_rope) in enumerate(zip(self.layers, kv_caches, ropes, strict=True)):
            if i in self.aux_layers:  # (a copy: the kernel path's fused norms add into residual in place)
                aux[i] = x.clone() if residual is None else x + residual
            x, residual = layer(x, residual, layer_rope, kv_cache, meta.for_layer(i), lora)
            if deepstack is not None and i < deepstack[1].shape[1]:  # the whole hidden state, added to as transformers does
                hidden = (x if residual is None else x + residual).index_add(0, deepstack[0], deepstack[1][:, i])
                x, residual = torch.zeros_like(hidden), hidden
        self.aux = torch.cat([aux[i] for i in self.aux_layers], dim=-1) if aux else None
        return self.norm(x, residual)[0]

    def checkpoint_filter(self) -> Callable[[str], bool] | None:
        """Which checkpoint tensors the model reads (None: all)."""
        return None

    def _layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        """What each layer does to its q and k heads this step: its rotation (none on NoPE
        layers; the windowed layers' own where they have one), then Llama 4's unit norms on
        rotated layers, and its attention temperature (Ministral 3's too) on the queries."""
        cfg = self.config
        rope: Rope = self.rotary.for_step(positions, dtype)
        local: Rope = rope if self.rotary_local is None else self.rotary_local.for_step(positions, dtype)
        unrotated: Rope = no_rope
        if cfg.unit_qk_norm:
            rope, local = UnitNormed(rope, cfg.rms_norm_eps), UnitNormed(local, cfg.rms_norm_eps)
        if (qs := cfg.query_scale) is not None:
            scale = 1 + qs.beta * torch.log1p(torch.floor((positions.float() + qs.offset) / qs.length))  # [T]
            scale = scale.to(dtype) if qs.rounded else scale
            unrotated = ScaledQueries(no_rope, scale)
            if not qs.nope_only:
                rope, local = ScaledQueries(rope, scale), ScaledQueries(local, scale)
        windows = cfg.layer_windows or (None,) * len(self.layers)
        return [unrotated if i in cfg.nope_layers else rope if window is None else local
                for i, window in enumerate(windows)]

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, hidden or labels]
        """What an embedding request's last row gives: its hidden state, or a classifier's
        label logits."""
        return self.score(hidden).float() if self.config.labels else hidden.float()

    def compute_logits(self, hidden: torch.Tensor, reuse: bool = False) -> torch.Tensor:
        """[num_rows, vocab] float32. `reuse`: into this model's LogitsBuffer, valid until the
        next such call (the step's sampling rows; a prompt's logprobs rows keep theirs)."""
        if reuse:
            logits = self.logits_buffer.logits(self.lm_head, hidden, self.config.vocab_size)
        else:
            logits = self.lm_head(hidden).float()
        if self.config.logits_divisor is not None:
            logits.div_(self.config.logits_divisor)
        return logits if self.config.final_softcap is None else apply_softcap(logits, self.config.final_softcap)

    def init_dummy_weights(self, std: float, seed: int = 0) -> None:
        """Seeded random weights instead of a checkpoint: normal(0, std) for embeddings and
        linear layers, ones for norms, zeros for biases. Drawn on the CPU in float32, so every
        device and dtype starts from the same values."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():  # a tied lm_head is the embedding, once
                owner, _, local = name.rpartition(".")
                module = self.get_submodule(owner)
                if quant.grid_part(local):
                    continue  # set with its quantized weight
                if local == "input_perm":  # GPTQ act-order's column order: none here
                    param.copy_(torch.arange(param.numel()))
                    continue
                if quant.is_quantized(module, local):  # the float weight the other layers draw, quantized
                    dense = torch.randn(quant.dense_shape(module, local), generator=generator).mul_(std)
                    quant.quantize_into(module, local, dense)
                elif name.endswith("norm.weight"):  # a scale of one
                    param.fill_(1.0 if isinstance(module, GatedRMSNorm) else 1.0 - (self.config.norm_weight_offset or 0.0))
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.copy_(torch.randn(param.shape, generator=generator).mul_(std))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     split: Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[tuple[str, torch.Tensor]]]
                     | None = None,
                     deal: Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[tuple[str, torch.Tensor]]]
                     | None = None) -> None:
        """Copy a Hugging Face checkpoint's tensors in, fusing q/k/v and gate/up and stacking
        experts. `split`: a tensor-parallel rank's part of each tensor (worker.model_executor.tensor_parallel's
        shard_weights), taken once quantized weights are in genq's layout; `deal`: with expert
        parallelism, its experts (worker.model_executor.tensor_parallel's deal_experts), taken before."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        weights = self._in_common_names(weights)
        if deal is not None:  # expert parallelism: this rank's experts (worker.model_executor.tensor_parallel.deal_experts)
            weights = deal(weights)
        if self.config.quant is not None:
            weights = quant.quantized_weights(weights, self.config.quant, self._quantized_owner)
        if split is not None:  # (what has no place in the model, an image encoder's, is not split)
            weights = split((name, t) for name, t in weights if _map_hf_name(name) is not None)
        if self.config.mla is not None and self.config.mla.interleaved_rope:
            weights = _mla_rope_rows(weights, self.config)
        found_scales: dict[tuple[int, str], torch.Tensor] = {}
        for hf_name, tensor in weights:
            if (scale := kv_scales.scale_target(hf_name)) is not None:
                found_scales[scale] = tensor
                continue
            target = _map_hf_name(hf_name, self.config.mla is not None)
            if target is None:
                continue
            name, shard = target
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
            if name.endswith(".input_perm"):  # a fused layer's shards read their inputs in one order
                _copy_order(params[name], tensor, any(key.startswith(name + ":") for key in loaded), hf_name)
            else:
                _copy_shard(params[name], tensor, shard, self.config, hf_name, self._rows_per_row(name))
            loaded.add(f"{name}:{shard}")
        self._check_complete(loaded)
        self._set_kv_scales(found_scales)

    def _in_common_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint in the names and layout of the families genq loads alike, less what
        it does not run (multi-token-prediction layers)."""
        arch = self.config.architecture
        if arch == "Glm4ForCausalLM":
            weights = _glm4_names(weights)
        weights = _without_mtp_layers(weights, self.config)
        if arch == "Qwen3NextForCausalLM" and self.config.linear is not None:  # (an MTP layer's model has none)
            weights = grouped_projections(weights, self.config.linear)
        if arch == "GraniteMoeHybridForCausalLM":
            weights = _granite_shared_mlp(weights, self.config.moe is not None)
        if arch == "NemotronHForCausalLM":
            moe = self.config.moe
            weights = _nemotron_h_names(weights, self.config.mlp_only_layers, moe.layers if moe else frozenset())
        if arch == "GptOssForCausalLM":
            quant_cfg = self.config.quant
            weights = gpt_oss.checkpoint_weights(weights, keep_mxfp4=quant_cfg is not None and quant_cfg.kind == "fp4")
        return weights

    def _set_kv_scales(self, found: dict[tuple[int, str], torch.Tensor]) -> None:
        """Each attention layer's KV-cache scales: every one has both or none has any (a layer
        with a state, or an MLP alone, keeps no KV)."""
        if not found and self.config.kv_cache_scheme is None:
            return
        attending = [i for i, layer in enumerate(self.layers) if isinstance(getattr(layer, "self_attn", None), Attention)]
        missing = [f"layers.{i}.self_attn.{kind}_scale" for i in attending for kind in "kv" if (i, kind) not in found]
        if missing:
            raise ValueError(f"checkpoint is missing KV-cache scales: {', '.join(missing[:8])}")
        cfg, device = self.config, next(self.parameters()).device
        for i in attending:
            attn = self.layers[i].self_attn
            assert isinstance(attn, Attention)
            attn.kv_scales = kv_scales.KVScales.of(found[i, "k"], found[i, "v"], cfg.num_key_value_heads,
                                                   cfg.num_attention_heads, device, i)

    def _rows_per_row(self, name: str) -> int:
        """Weight rows per row of a parameter: a quantized weight's scales (and zero points)
        are loaded by shard as the weight is, a row per block of rows."""
        if not quant.grid_part(name):
            return 1
        block: tuple[int, int] = getattr(self.get_submodule(name.rpartition(".")[0]), "block")  # noqa: B009
        return block[0]

    def _quantized_owner(self, hf_name: str) -> nn.Module | None:
        """The module whose quantized weight a checkpoint weight loads into, if it is one."""
        target = _map_hf_name(hf_name, self.config.mla is not None)
        if target is None:
            return None
        module_name, _, local = target[0].rpartition(".")
        try:
            module = self.get_submodule(module_name)
        except AttributeError:  # no place in the model: load_weights says so
            return None
        return module if quant.is_quantized(module, local) else None

    def _check_complete(self, loaded: set[str]) -> None:
        tied = self.config.tie_word_embeddings
        expected = [
            f"{name}:{shard}"
            for name, _ in self.named_parameters()
            if not (tied and name == "lm_head.weight") and f"{name}:None" not in loaded
            for shard in self._shards(name)
        ]
        missing = [key.removesuffix(":None") for key in expected if key not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")


    def _shards(self, name: str) -> list[str | None]:
        """The pieces a parameter is loaded in: q/k/v, gate/up, or one per expert."""
        parts = name.split(".")
        if len(parts) > 1 and parts[-2] == "experts" and self.config.moe is not None:
            w13 = parts[-1].removesuffix(quant.grid_part(parts[-1])) == "w13"
            kinds = (("gate", "up") if self.config.moe.gated else ("up",)) if w13 else ("down",)
            return [f"{kind}.{e}" for e in range(self.config.moe.num_local_experts) for kind in kinds]
        return list(_SHARDS.get(parts[-2] if len(parts) > 1 else "", [None]))


class HiddenStateDraft(LlamaForCausalLM):
    """A draft layer that reads a hidden state for every row beside its token (a checkpoint's
    MTP layer, an EAGLE-3 head), which the runner passes as `hidden`; it shares what it has
    not of its own with the target model (`share_with`)."""

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [T]: token i + 1 at the row for position i
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: Any,
        lora: LoRAMapping | None = None,
        # rows [k] whose token is given as embeddings (an image's, a prompt's: the target's), and those
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        hidden: torch.Tensor | None = None,  # [T, width]: the target's state at i, or the draft's own output
    ) -> torch.Tensor:  # [T, hidden]
        assert hidden is not None, f"{type(self).__name__} reads a hidden state for every row"
        embeds = self.embed_tokens(input_ids)
        if images is not None:
            given = images[1].to(embeds.dtype)
            embeds = embeds.index_copy(0, images[0], given[:, 0] if given.dim() == 3 else given)  # (not deepstack's)
        return self.draft(embeds, positions, kv_caches, meta, hidden)

    def draft(self, embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              meta: Any, hidden: torch.Tensor) -> torch.Tensor:
        """Rows' token embeddings [T, hidden] and states in, the layer's output out."""
        raise NotImplementedError

    def share_with(self, target: LlamaForCausalLM) -> None:
        raise NotImplementedError


_FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
_SHARDS = {"qkv_proj": ["q", "k", "v"], "gate_up_proj": ["gate", "up"]}
# one expert's projection in a checkpoint (Mixtral's w1/w3/w2, Qwen's names) -> its piece
_EXPERT_PROJ = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
# GraniteMoE's checkpoint names: stacked experts and the router
_GRANITE_MOE = {".mlp.input_linear.weight": ".mlp.experts.gate_up_proj", ".mlp.output_linear.weight": ".mlp.experts.down_proj",
                ".mlp.router.layer.weight": ".mlp.gate.weight", ".mlp.router.weight": ".mlp.gate.weight"}
# experts already stacked (transformers >= 5 holds them so): [E, 2 * I, H] and [E, H, I]
# (Nemotron 3's, without a gate: up [E, I, H])
_STACKED = {"gate_up_proj": "w13", "down_proj": "w2", "gate_up_proj_bias": "w13_bias", "down_proj_bias": "w2_bias",
            "up_proj": "w13"}


# an image-text (or audio-text) model's language model, as its checkpoints name it (older,
# then newer transformers), and what genq does not load of it
_LANGUAGE_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.", "language_model.lm_head.": "lm_head."}
_NOT_LANGUAGE = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                 "visual.", "model.visual.", "vision_model.", "model.vision_model.",
                 "audio_tower.", "model.audio_tower.",
                 "mtp.")  # (Qwen3.5's multi-token-prediction layer, which genq does not run)


# GLM-4's four norms a layer, under Gemma 2's names: after attention, before the MLP, after it
_GLM4_NORMS = {".post_self_attn_layernorm.": ".post_attention_layernorm.",
               ".post_attention_layernorm.": ".pre_feedforward_layernorm.",
               ".post_mlp_layernorm.": ".post_feedforward_layernorm."}


def _glm4_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        old = next((old for old in _GLM4_NORMS if old in name), None)
        yield (name.replace(old, _GLM4_NORMS[old]) if old else name), tensor


def _granite_shared_mlp(weights: Iterable[tuple[str, torch.Tensor]], experts: bool
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Granite 4.0's shared MLP ([gate; up] in input_linear, down in output_linear): the
    experts' shared expert, or a dense model's MLP."""
    into = ".mlp.shared_expert." if experts else ".mlp."
    for name, tensor in weights:
        if ".shared_mlp." in name:
            name = name.replace(".shared_mlp.", into).replace(".input_linear.", ".gate_up_proj.").replace(
                ".output_linear.", ".down_proj.")
        yield name, tensor


def _nemotron_h_names(weights: Iterable[tuple[str, torch.Tensor]], mlp_layers: frozenset[int],
                      moe_layers: frozenset[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Nemotron-H's `backbone` under Llama's names: each layer's `mixer` its attention (or
    Mamba2), or its MLP, or its experts (Nemotron 3's); its one `norm` the input norm."""
    for name, tensor in weights:
        name = name.replace("backbone.", "model.", 1).replace("model.embeddings.", "model.embed_tokens.")
        name = name.replace("model.norm_f.", "model.norm.")
        parts = name.split(".")
        if len(parts) > 3 and parts[1] == "layers":
            if parts[3] == "norm":
                parts[3] = "input_layernorm"
            elif parts[3] == "mixer":
                layer = int(parts[2])
                parts[3] = "mlp" if layer in mlp_layers | moe_layers else "self_attn"
                # an MLP without a gate (the shared expert's too): not gate_up_proj's up
                gateless = 4 if layer in mlp_layers else 5 if parts[4] == "shared_experts" else None
                if gateless is not None:
                    parts[gateless] = {"up_proj": "up", "down_proj": "down"}.get(parts[gateless], parts[gateless])
        yield ".".join(parts), tensor


def _mla_rope_rows(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """A latent-attention checkpoint whose RoPE columns come as interleaved pairs, with the
    rows that make them (each head's last qk_rope_head_dim rows of the query projection, the
    last ones of kv_a_proj_with_mqa) reordered to halves, as `half_split_rows` does for q and k."""
    mla = cfg.mla
    assert mla is not None
    rope, head = mla.qk_rope_head_dim, mla.qk_nope_head_dim + mla.qk_rope_head_dim
    for name, tensor in weights:
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            tensor = half_split_rows(tensor, head, rope, start=head - rope)
        elif name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
            tensor = half_split_rows(tensor, len(tensor), rope, start=len(tensor) - rope)
        yield name, tensor


def _without_mtp_layers(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint less its multi-token-prediction layers (DeepSeek-V3's, GLM-4.5's and
    MiniMax-M2's, numbered after the decoder's), which genq does not run."""
    hf = cfg.hf_config
    mtp = (getattr(hf, "num_nextn_predict_layers", 0) or 0) or (
        (getattr(hf, "num_mtp_modules", 0) or 0) if getattr(hf, "use_mtp", False) else 0)
    skipped = tuple(f"model.layers.{i}." for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + mtp))
    return ((name, tensor) for name, tensor in weights if not (skipped and name.startswith(skipped)))


def _map_hf_name(hf_name: str, mla: bool = False) -> tuple[str, str | None] | None:
    """`mla`: a latent-attention model's, whose q_proj stands alone."""
    if "rotary_emb" in hf_name or hf_name.startswith(_NOT_LANGUAGE):
        return None  # recomputed, or not the language model's
    for prefix, new in _LANGUAGE_PREFIXES.items():
        if hf_name.startswith(prefix):
            hf_name = new + hf_name[len(prefix):]
            break
    name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name
    name = name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")  # MiniMax-M2's
    name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")  # DeepSeek's name
    name = name.replace(".feed_forward.router.", ".mlp.gate.").replace(".feed_forward.", ".mlp.")  # Llama 4's
    name = name.replace(".linear_attn.", ".self_attn.").replace(".mamba.", ".self_attn.")  # Qwen3.5's, Granite 4.0's
    for old, new in _GRANITE_MOE.items():
        name = name.replace(old, new)
    parts = name.split(".")
    if "experts" in parts[:-1]:
        i = parts.index("experts")
        scale = quant.grid_part(parts[-1])  # a quantized weight's scales or zero points
        if parts[i + 1].isdigit() and len(parts) > i + 2 and parts[i + 2] in _EXPERT_PROJ:
            kind = _EXPERT_PROJ[parts[i + 2]]  # experts.<e>.<proj>.weight
            return ".".join(parts[: i + 1] + [("w2" if kind == "down" else "w13") + scale]), f"{kind}.{parts[i + 1]}"
        if parts[i + 1].removesuffix(scale) in _STACKED:
            return ".".join(parts[: i + 1] + [_STACKED[parts[i + 1].removesuffix(scale)] + scale]), None
    for i, part in enumerate(parts):
        if part in _FUSED and not (mla and part == "q_proj"):
            fused, shard = _FUSED[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
    return name, None


def _copy_order(param: torch.Tensor, order: torch.Tensor, shared: bool, hf_name: str) -> None:
    """A GPTQ act-order layer's column order (`input_perm`): a fused layer's shards (q, k and
    v; gate and up) read the same inputs, quantized in the same order; `shared`: a shard
    before this one set it."""
    if param.shape != order.shape:
        raise ValueError(f"shape mismatch for {hf_name!r}: model {tuple(param.shape)}, checkpoint {tuple(order.shape)}")
    if shared and not torch.equal(param.cpu(), order.cpu()):
        raise ValueError(f"{hf_name!r}: the shards of one fused layer order their columns differently (g_idx), "
                         "which genq cannot serve")
    with torch.no_grad():
        param.copy_(order)


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard: str | None, cfg: ModelConfig,
                hf_name: str, row_block: int = 1) -> None:
    """`row_block`: weight rows per row of `param` (a quantized layer's scales)."""
    with torch.no_grad():
        dst = param
        if shard is not None:
            kind, _, expert = shard.partition(".")
            if expert:  # one expert's piece of the stacked weights
                dst = dst[int(expert)]
            if kind != "down":
                start, size = _shard_range(kind, cfg, dst.shape[0] * row_block)
                dst = dst.narrow(0, start // row_block, size // row_block)
        if hf_name.endswith("_scale") and tensor.numel() == 1:
            tensor = tensor.reshape(()).expand(dst.shape)  # one scale for the whole tensor
        if hub_stacked_experts(cfg, hf_name) and tensor.transpose(1, 2).shape == dst.shape:
            tensor = tensor.transpose(1, 2)
        if dst.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {hf_name!r}: model {tuple(dst.shape)}, checkpoint {tuple(tensor.shape)}")
        if cfg.interleaved_rope and shard in ("q", "k"):
            if row_block == 1:  # a weight's rows, or per-channel scales
                tensor = half_split_rows(tensor, cfg.head_dim, cfg.rotary_dim)
            elif row_block % cfg.head_dim:
                raise ValueError(f"{hf_name!r}: scale blocks of {row_block} rows would split the heads whose "
                                 f"rows this model reorders ({cfg.head_dim} each)")
        dst.copy_(tensor)


def hub_stacked_experts(cfg: ModelConfig, hf_name: str) -> bool:
    """Stacked experts as Qwen3-VL-MoE's Hub checkpoints hold them, inputs before outputs
    ([E, H, 2 * I] and [E, I, H]); transformers 5 saves them the other way round, as genq
    keeps them. The shapes tell which (a square one is taken as the Hub's). Llama 4's
    checkpoints (and transformers' own module) hold them inputs first too."""
    return (getattr(cfg.hf_config, "model_type", None) in ("qwen3_vl_moe_text", "llama4_text")
            and hf_name.endswith((".experts.gate_up_proj", ".experts.down_proj")))


def half_split_rows(rows: torch.Tensor, head_dim: int, rotary_dim: int | None = None, start: int = 0) -> torch.Tensor:
    """q or k projection rows [heads * head_dim, ...] reordered within each head from
    interleaved pairs (0, 1), (2, 3) ... to halves (0, 2, 4 ... | 1, 3, 5 ...): rotating the
    halves then rotates each interleaved pair, and q · k is unchanged by the same order on both.
    With partial rotary only the `rotary_dim` rows of a head from `start` are reordered (the
    first ones; DeepSeek's latent attention rotates each head's last ones)."""
    rotary = rotary_dim or head_dim
    order = torch.cat((torch.arange(start), start + torch.arange(0, rotary, 2), start + torch.arange(1, rotary, 2),
                       torch.arange(start + rotary, head_dim)))
    heads = rows.view(-1, head_dim, *rows.shape[1:])
    return heads[:, order.to(rows.device)].reshape(rows.shape)


def _shard_range(shard: str, cfg: ModelConfig, rows: int) -> tuple[int, int]:
    """Where a piece lies in the fused weight of `rows` rows."""
    q_size = cfg.num_attention_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)  # (with the gates)
    kv_size = cfg.num_key_value_heads * cfg.head_dim
    return {
        "q": (0, q_size),
        "k": (q_size, kv_size),
        "v": (q_size + kv_size, kv_size),
        "gate": (0, rows // 2),
        "up": (rows // 2, rows // 2) if cfg.moe is None or cfg.moe.gated else (0, rows),  # (experts without a gate)
    }[shard]
