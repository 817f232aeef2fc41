"""DeepSeek's multi-head latent attention (MLA), attending in the latent space.

Each token writes one latent `c` [kv_lora_rank] (normalized) and one RoPE key `k_pe`
[qk_rope_head_dim], shared by every head; a head's key [nope | rope] and value would be
`kv_b_proj`'s up-projections of `c` with `k_pe` beside. Instead of expanding them for every
cached token, the up-projections are absorbed into the query and the output, as vLLM's MLA
backends do: a head's score is q_nope · (W_uk c) + q_pe · k_pe = (W_ukᵀ q_nope) · c + q_pe · k_pe,
and its output W_uv (Σ p c). So the cache holds [c | k_pe] as one KV head (num_key_value_heads
1, head_dim kv_lora_rank + qk_rope_head_dim), keys and values alike: the attention backends
serve it as multi-query attention whose value is the key itself, of which the first
kv_lora_rank columns are kept. K and V share one pool (the runner allocates it once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from worker.model_executor.models.config import MLAConfig, ModelConfig


class KVUpProjection(nn.Module):
    """`kv_b_proj`'s weight [heads * (nope + v), kv_lora_rank], read as two per-head matrices,
    never run as a linear layer (so never packed or quantized as one)."""

    def __init__(self, heads: int, mla: MLAConfig):
        super().__init__()
        self.heads, self.mla = heads, mla
        self.weight = nn.Parameter(torch.empty(heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank))

    def key_value(self) -> tuple[torch.Tensor, torch.Tensor]:  # [H, nope, kv_lora], [H, v, kv_lora]
        per_head = self.weight.view(self.heads, -1, self.mla.kv_lora_rank)
        return per_head.split([self.mla.qk_nope_head_dim, self.mla.v_head_dim], dim=1)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, make_norm: Any):
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.mla = mla
        self.num_heads = cfg.num_attention_heads
        qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        bias = cfg.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = make_norm(cfg, mla.q_lora_rank)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = make_norm(cfg, mla.kv_lora_rank)
        self.kv_b_proj = KVUpProjection(self.num_heads, mla)
        self.o_proj = nn.Linear(self.num_heads * mla.v_head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.scale = cfg.attn_scale
        # tensor parallelism: sums o_proj's partial outputs over the ranks (worker.model_executor.tensor_parallel);
        # each rank holds its share of the heads and the whole latent cache
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: Any,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: Any,
        lora: Any = None,  # refused for these models at engine start
    ) -> torch.Tensor:
        mla, num_tokens = self.mla, x.shape[0]
        q = self.q_proj(x) if mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, kv_lora]
        # the queries' and the shared key's RoPE columns rotated in one pass: [T, H + 1, rope]
        pe = rope(torch.cat((q_pe, k_pe[:, None]), dim=1), self.num_heads)
        w_uk, w_uv = self.kv_b_proj.key_value()
        q_latent = torch.einsum("thn,hnc->thc", q_nope, w_uk)  # [T, H, kv_lora]
        q = torch.cat((q_latent, pe[:, : self.num_heads]), dim=-1)  # [T, H, kv_lora + rope]
        kv = torch.cat((latent, pe[:, self.num_heads]), dim=-1)[:, None]  # [T, 1, kv_lora + rope]
        o = meta.forward(q, kv, kv, kv_cache, self.scale, None, None, None)  # [T, H, kv_lora + rope]
        o = torch.einsum("thc,hvc->thv", o[..., : mla.kv_lora_rank], w_uv)  # [T, H, v]
        out = self.o_proj(o.reshape(num_tokens, -1))
        return out if self.reduce is None else self.reduce(out)

