"""A checkpoint's scales for an fp8 KV cache (compressed-tensors' `kv_cache_scheme`, which
llm-compressor writes): each layer's keys and values were calibrated, and the cache holds
k / k_scale and v / v_scale, so keys and values past fp8's +-448 are not clipped and small
ones keep their precision. One scale a layer (strategy "tensor") or one per KV head
("attn_head"), stored as `model.layers.N.self_attn.k_scale` and `v_scale` (older checkpoints:
`k_proj.output_scale`, `v_proj.output_scale`), and NVIDIA ModelOpt's (`kv_cache_quant_algo`
FP8: one a layer, as `k_proj.k_scale` and `v_proj.v_scale`).

The scales are read when the cache is fp8 (`kv_cache_dtype="fp8"`); a cache in the model's
dtype holds keys and values as they are and needs none. Attention then reads the cache as it
is stored: each query head takes its KV head's k_scale (q . k = (q * s) . (k / s)), and its
output the v_scale, so neither attention path nor kernel changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

# a layer's K or V scale as checkpoints name it; q's (attention quantized too) is not needed:
# genq attends in the model's dtype
# (ModelOpt's: k_proj.k_scale, v_proj.v_scale)
_SCALE_NAME = re.compile(r"layers\.(\d+)\.self_attn\.(?:(?:[kqv]_proj\.)?([kqv])_scale|([kqv])_proj\.output_scale)$")


def kv_cache_scheme(hf_config: Any) -> str | None:
    """The strategy of the checkpoint's KV-cache scales ("tensor" or "attn_head"), or None
    when it has none; ValueError for a scheme genq cannot serve."""
    qc = getattr(hf_config, "quantization_config", None)
    qc = qc if isinstance(qc, dict) or qc is None else qc.to_dict()
    if (qc or {}).get("quant_method") == "modelopt":  # NVIDIA ModelOpt's: fp8, a scale a layer
        algo = (qc or {}).get("kv_cache_quant_algo")
        if algo not in (None, "FP8"):
            raise ValueError(f"ModelOpt kv_cache_quant_algo {algo!r} is not supported; supported: FP8")
        return None if algo is None else "tensor"
    scheme = (qc or {}).get("kv_cache_scheme")
    if not scheme:
        return None
    kind = (scheme.get("type"), scheme.get("num_bits"), scheme.get("symmetric", True), bool(scheme.get("dynamic")))
    strategy = scheme.get("strategy") or "tensor"
    if kind != ("float", 8, True, False) or strategy not in ("tensor", "attn_head"):
        raise ValueError(f"kv_cache_scheme {scheme!r} is not supported; supported: static, symmetric 8-bit float "
                         "scales per tensor or per attention head (fp8 e4m3)")
    return str(strategy)


def scale_target(hf_name: str) -> tuple[int, str] | None:
    """(layer, "k", "v" or "q") when a checkpoint tensor is a KV-cache (or query) scale."""
    found = _SCALE_NAME.search(hf_name)
    if found is None:
        return None
    return int(found.group(1)), found.group(2) or found.group(3)


@dataclass(frozen=True)
class KVScales:
    """One layer's scales, laid out for the heads they serve. One a layer (every head's the
    same) folds into attention's softmax scale and one product of the output; one per KV head
    scales each query head."""

    k: torch.Tensor  # [num_kv_heads, 1] float32: the cache holds k / k
    v: torch.Tensor
    q_heads: torch.Tensor  # [num_heads, 1]: each query head's KV head's k scale
    out_heads: torch.Tensor  # [num_heads, 1]: ... and v scale
    per_layer: tuple[float, float] | None = None  # (k, v) when every head shares them

    @classmethod
    def of(cls, k_scale: torch.Tensor, v_scale: torch.Tensor, num_kv_heads: int, num_heads: int,
           device: torch.device, layer: int) -> KVScales:
        per_head = [_per_head(t, num_kv_heads, f"layers.{layer}.self_attn.{kind}_scale").to(device)
                    for t, kind in ((k_scale, "k"), (v_scale, "v"))]
        group = num_heads // num_kv_heads  # query head h reads KV head h // group
        k, v = per_head
        shared = all(bool((t == t[0]).all()) for t in (k, v))
        return cls(k, v, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0),
                   (float(k[0]), float(v[0])) if shared else None)

    def into_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float  # [T, heads, D]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """The query (or the softmax scale) scaled, and the keys and values as the cache holds
        them."""
        if self.per_layer is not None:
            k_scale, v_scale = self.per_layer
            return q, k / k_scale, v / v_scale, scale * k_scale
        return ((q.float() * self.q_heads).to(q.dtype), (k.float() / self.k).to(k.dtype),
                (v.float() / self.v).to(v.dtype), scale)

    def out_of_cache(self, o: torch.Tensor) -> torch.Tensor:  # [T, num_heads, D]
        """Attention over values the cache holds divided by their scale, scaled back."""
        if self.per_layer is not None:
            return o * self.per_layer[1]
        return (o.float() * self.out_heads).to(o.dtype)


def _per_head(scale: torch.Tensor, num_kv_heads: int, name: str) -> torch.Tensor:
    """A scale per layer or per KV head, as [num_kv_heads, 1] float32."""
    flat = scale.detach().float().reshape(-1)
    if flat.numel() not in (1, num_kv_heads):
        raise ValueError(f"{name!r} has shape {tuple(scale.shape)}: a KV-cache scale is one value a layer "
                         f"or one per KV head ({num_kv_heads})")
    if not bool(torch.isfinite(flat).all()) or bool((flat <= 0).any()):
        raise ValueError(f"{name!r} holds {flat.tolist()}: a KV-cache scale must be finite and positive")
    return flat.expand(num_kv_heads).reshape(num_kv_heads, 1).contiguous()
