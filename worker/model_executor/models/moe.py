"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, GraniteMoE, gpt-oss, GLM-4.5, Llama 4,
Nemotron 3) over a flat batch of tokens.

Each expert is a SwiGLU MLP. Their weights are stacked at load time, vLLM's layout:
`w13` [num_experts, 2 * intermediate, hidden] holds each expert's gate and up projections,
`w2` [num_experts, hidden, intermediate] its down projection (gpt-oss: with biases `w13_bias`,
`w2_bias`, and a clamped SwiGLU; Nemotron 3: no gate, `w13` its up projection alone and
ReLU^2 between). A router (one linear layer) scores the experts for each token; the token's
output is the weighted sum of its top-k experts' outputs.

On the torch path the experts run one after another over the tokens routed to them, with
transformers' rounding, so outputs equal transformers' on the same weights (bitwise in
bfloat16 on the CPU). On the kernel
path (CUDA) one Triton kernel runs all experts' matmuls over tokens grouped by expert
(`kernels.fused_moe`), with fixed-size launches that CUDA graphs can capture.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from worker.model_executor.models import quant
from worker.model_executor.models.config import MoEConfig
from worker.model_executor.models.packed_linear import pack_weight, packed_linear


class Experts(nn.Module):
    w13_scale: torch.Tensor  # quantized weights' scales, once use_quantized made them
    w2_scale: torch.Tensor
    w13_zero: torch.Tensor  # and zero points, with zero_points
    w2_zero: torch.Tensor

    def __init__(self, moe: MoEConfig, hidden_size: int, use_kernel: bool):
        super().__init__()
        # the experts this rank holds (expert parallelism: its share, whole); a pair routed to
        # id num_experts is another rank's, and adds nothing here
        self.num_experts = moe.num_local_experts
        self.all_experts = moe.expert_ranks == 1
        self.first_expert = 0  # expert parallelism: the id of this rank's first expert (reduce_with sets it)
        self.intermediate_size = moe.intermediate_size
        rows = (2 if moe.gated else 1) * moe.intermediate_size
        self.gated = moe.gated
        self.w13 = nn.Parameter(torch.empty(self.num_experts, rows, hidden_size))
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden_size, moe.intermediate_size))
        self.use_kernel = use_kernel
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per expert, see pack()
        self.hidden_size = hidden_size
        self.block: tuple[int, int] | None = None  # quantized weights: rows, columns per scale
        self.kind = "fp8"  # quantized weights: their values (see use_quantized)
        self.zero_points = False  # quantized integers come with int8 zero points `w13_zero`, `w2_zero`
        self.bias = moe.bias
        if moe.bias:
            self.w13_bias = nn.Parameter(torch.empty(self.num_experts, rows))
            self.w2_bias = nn.Parameter(torch.empty(self.num_experts, hidden_size))
        # w13's products [rows of work, w13's rows] -> the inputs of w2
        self.activation: Callable[[torch.Tensor], torch.Tensor] = (
            relu_squared if not moe.gated else silu_and_mul if moe.clamped_swiglu is None
            else partial(clamped_swiglu, *moe.clamped_swiglu))

    def use_quantized(self, block: tuple[int, int], kind: str, zero_points: bool = False) -> None:
        """Hold w13 and w2 as `kind` values (fp8, int8, int4 packed) with float32 scales
        `w13_scale`, `w2_scale` per `block`, and with `zero_points` int8 ones laid out as
        the scales (on the meta device, before the weights load)."""
        self.block, self.kind, self.zero_points = block, kind, zero_points
        for name in ("w13", "w2"):
            quant.make_quantized(self, name, block, kind, zero_points)

    def pack(self, batch_hint: int) -> None:
        """Lay each expert's weights out for oneDNN once (on the CPU, as
        `pack_linears` does for linear layers); the stacked weights are freed."""
        self.packed = [(pack_weight(self.w13[e], batch_hint), pack_weight(self.w2[e], batch_hint))
                       for e in range(self.num_experts)]
        del self.w13, self.w2

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        topk_weights: torch.Tensor,  # [T, top_k]: float32, or the activation dtype
        topk_ids: torch.Tensor,  # [T, top_k] int64; num_experts: another rank's expert
    ) -> torch.Tensor:  # [T, hidden]
        if self.use_kernel:
            import kernels

            quantized = self.block is not None
            return kernels.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids,
                                     self.w13_scale if quantized else None, self.w2_scale if quantized else None,
                                     self.block, activation=self.activation, gated=self.gated,
                                     w13_bias=self.w13_bias if self.bias else None,
                                     w2_bias=self.w2_bias if self.bias else None,
                                     w13_zero=self.w13_zero if self.zero_points else None,
                                     w2_zero=self.w2_zero if self.zero_points else None)
        return self._forward_torch(x, topk_weights, topk_ids)

    def _forward_torch(self, x, topk_weights, topk_ids):
        num_tokens, top_k = topk_ids.shape
        # one row per (token, choice) pair; those of another rank's experts stay zero
        out = (x.new_empty if self.all_experts else x.new_zeros)(num_tokens * top_k, x.shape[1])
        # the pairs each expert serves, grouped; one host sync per layer
        flat = topk_ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        start = 0
        for expert, count in enumerate(counts[: self.num_experts]):
            if count == 0:
                continue
            pairs = order[start : start + count]
            start += count
            gate_up = self._linear(x[pairs // top_k], expert, 0)
            if self.bias:  # added after the product is rounded, as transformers does
                gate_up = gate_up + self.w13_bias[expert]
            down = self._linear(self.activation(gate_up), expert, 1)
            out[pairs] = down + self.w2_bias[expert] if self.bias else down
        return combine(out, topk_weights)

    def _linear(self, x: torch.Tensor, expert: int, which: int) -> torch.Tensor:  # which: 0 w13, 1 w2
        if self.packed is not None:
            return packed_linear(x, self.packed[expert][which])
        return F.linear(x, (self.w13, self.w2)[which][expert])


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(alpha: float, limit: float, gate_up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gated unit: the gate clamped from above, up clamped both ways and shifted by one."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def relu_squared(up: torch.Tensor) -> torch.Tensor:
    """Nemotron 3's experts' unit, without a gate."""
    return F.relu(up).square_()


def pack_experts(model: nn.Module, batch_hint: int) -> int:
    """`Experts.pack` every mixture-of-experts layer of `model`; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, Experts)]
    for experts in layers:
        experts.pack(batch_hint)
    return len(layers)


def combine(out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Each token's pairs' outputs [T * k, hidden], weighted and summed: [T, hidden]. As in
    transformers: the product takes the weights' dtype (float32 for Mixtral), the sum over k
    accumulates in float32 and is rounded once to the activation dtype."""
    num_tokens, top_k = topk_weights.shape
    weighted = out * topk_weights.reshape(-1, 1)
    return weighted.view(num_tokens, top_k, -1).sum(dim=1).to(out.dtype)


class SparseMoeBlock(nn.Module):
    """The router, the routed experts and, for Qwen2-MoE, DeepSeek-V3 and Nemotron 3, the shared
    expert (`mlp_cls`, as wide as `MoEConfig.shared_expert_size`)."""

    def __init__(self, moe: MoEConfig, hidden_size: int, use_kernel: bool, mlp_cls: type[nn.Module]):
        super().__init__()
        self.moe = moe
        self.gate: nn.Linear | GroupedTopkRouter  # the router
        if moe.deepseek_router:
            self.gate = GroupedTopkRouter(moe, hidden_size)
        else:
            self.gate = nn.Linear(hidden_size, moe.num_experts, bias=moe.bias)
        # Nemotron 3 Super: the experts work in a narrower space, projected into and out of once
        if moe.latent_size:
            self.fc1_latent_proj = nn.Linear(hidden_size, moe.latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(moe.latent_size, hidden_size, bias=False)
        self.experts = Experts(moe, moe.latent_size or hidden_size, use_kernel)
        if moe.shared_expert_size:
            self.shared_expert = mlp_cls(hidden_size, moe.shared_expert_size, False)
            if moe.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        # tensor parallelism: sums the experts' partial outputs (each rank holds a share of
        # every expert's features, or some experts whole, and a share of the shared expert's)
        # over the ranks, once
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:  # [T, hidden]; LoRA skips the routed experts
        topk_weights, topk_ids = self.route(x)
        if self.moe.expert_ranks > 1:  # ids among this rank's experts; others' pairs: num_local_experts
            local = topk_ids - self.experts.first_expert
            topk_ids = local.masked_fill((local < 0) | (local >= self.moe.num_local_experts), self.moe.num_local_experts)
        if self.moe.weights_on_input:
            out = self._weighted_inputs(x, topk_weights, topk_ids)
        elif self.moe.latent_size:  # (under tensor parallelism fc2 takes partial sums: it has no bias)
            out = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), topk_weights, topk_ids))
        else:
            out = self.experts(x, topk_weights, topk_ids)
        if self.moe.shared_expert_size:
            shared = self.shared_expert(x, lora)  # (adapters apply to it, as to a dense MLP)
            out = out + (torch.sigmoid(self.shared_expert_gate(x)) * shared if self.moe.shared_expert_gated else shared)
        return out if self.reduce is None else self.reduce(out)

    def _weighted_inputs(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Llama 4's experts: each (token, expert) pair's input is the token scaled by the
        pair's weight (rounded to the activation dtype, as transformers does), and the pairs'
        outputs are summed unweighted."""
        num_tokens, top_k = topk_ids.shape
        scaled = x.repeat_interleave(top_k, dim=0) * topk_weights.reshape(-1, 1)  # [T * k, hidden], (token, choice)
        ones = torch.ones(num_tokens * top_k, 1, dtype=topk_weights.dtype, device=x.device)
        out = self.experts(scaled, ones, topk_ids.reshape(-1, 1))
        return out if top_k == 1 else out.view(num_tokens, top_k, -1).sum(dim=1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x: [T, hidden]
        """Each token's experts: weights [T, k] (float32, or the activation dtype) and ids [T, k]."""
        if isinstance(self.gate, GroupedTopkRouter):
            topk_weights, topk_ids = self.gate.route(x)
        else:
            topk_weights, topk_ids = route(self.gate(x), self.moe)
        return topk_weights if self.moe.float32_weights else topk_weights.to(x.dtype), topk_ids


class GroupedTopkRouter(nn.Module):
    """DeepSeek's router: float32 weights whatever the model's dtype (as transformers keeps
    them) and group-limited choice (`MoEConfig.num_groups`); V3's sigmoid scores come with a
    correction bias that steers the choice of experts alone."""

    def __init__(self, moe: MoEConfig, hidden_size: int):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size, dtype=torch.float32))
        if moe.sigmoid_scores:
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        """Moves follow the model; casts do not (a cast to bfloat16 would round the scores)."""
        def keep_float32(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            if moved.dtype == t.dtype:
                return moved
            return torch.empty_like(t, device=moved.device) if t.is_meta else t.to(moved.device)

        return super()._apply(keep_float32, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> logits [T, E] float32
        return F.linear(x.float(), self.weight)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x: [T, hidden]
        """Weights [T, k] float32 and expert ids [T, k]."""
        moe = self.moe
        if moe.sigmoid_scores:
            scores = self(x).sigmoid()  # [T, E]
            choice = scores + self.e_score_correction_bias
        else:
            scores = choice = self(x).softmax(dim=-1)
        if moe.num_groups > 1:  # only experts of the best groups can be chosen
            groups = choice.view(len(x), moe.num_groups, -1)  # [T, G, E / G]
            group_scores = groups.topk(2, dim=-1).values.sum(dim=-1) if moe.sigmoid_scores else groups.amax(dim=-1)
            best = group_scores.topk(moe.topk_groups, dim=-1).indices  # [T, topk_groups]
            kept = torch.zeros(groups.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, best, True)
            choice = groups.masked_fill(~kept[..., None], float("-inf")).view_as(scores)
        topk_ids = choice.topk(moe.top_k, dim=-1).indices
        topk_weights = scores.gather(1, topk_ids)
        if moe.renormalize:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_weights * moe.routed_scaling, topk_ids


def route(router_logits: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token by softmax probability (float32): weights [T, k], ids [T, k]."""
    if moe.sigmoid_scores:  # Llama 4: the top k logits, each weighed by its sigmoid
        top_logits, topk_ids = torch.topk(router_logits, moe.top_k, dim=-1)
        return torch.sigmoid(top_logits.float()), topk_ids
    if moe.softmax_after_topk:
        top_logits, topk_ids = torch.topk(router_logits.float(), moe.top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1), topk_ids
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
