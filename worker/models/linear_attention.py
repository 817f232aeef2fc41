"""Gated DeltaNet, the linear attention of Qwen3.5's hybrid layers (three of every four), and
the per-request state it keeps in place of a KV cache.

Each such layer keeps, for every running request, a fixed-size state: the last
`conv_kernel - 1` inputs of its short causal convolution, and one recurrent matrix
[key_head_dim, value_head_dim] per value head (float32). A token updates it by the gated
delta rule,

    S <- a S + k (beta (v - a S^T k))^T,    a = exp(g),    o = S^T q,

with q and k L2-normalized and q scaled by key_head_dim ** -0.5. A chunk of tokens is
computed at once in its closed form: within the chunk the values written, u, solve a unit
lower-triangular system, and the outputs and the final state follow by matrix products
(the DeltaNet papers' "WY" form). A step's decodes run together, one recurrence step over
their states gathered from their slots.

The state depends on every token before, so what the prefix cache saves (blocks of keys and
values) cannot restore it: models with these layers run without prefix caching, n > 1
completions each compute their prompt, and a preempted request recomputes from its first
token, its state reset. Plain torch, on every device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.config import LinearAttentionConfig

CHUNK = 64  # tokens solved together in a prefill


@dataclass
class StateMetadata:
    """A step's requests in the linear-attention layers: each one's rows of the flat batch and
    its slot of the states; the first `num_decodes` are decodes (a row each), run together."""

    states: LinearStates
    rows: list[tuple[int, int]]
    slots: list[int]
    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes] int64


class LinearStates:
    """Every running request's state in every linear-attention layer, a slot each of
    `max_requests` (the scheduler runs no more at once): the last inputs of the convolution
    [slots, layers, conv_dim, conv_kernel - 1] in the model's dtype, the recurrent matrices
    [slots, layers, value heads, key_head_dim, value_head_dim] in float32. A request takes a
    slot, zeroed, when its first chunk runs (again when it starts over after a preemption) and
    gives it back when it ends or is preempted. (Allocated empty: on the CPU the memory of
    slots never used is never touched.)"""

    def __init__(self, cfg: LinearAttentionConfig, num_layers: int, max_requests: int, dtype: torch.dtype,
                 device: torch.device):
        self.cfg, self.device = cfg, device
        self.conv = torch.empty(max_requests, num_layers, cfg.conv_dim, cfg.conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.empty(max_requests, num_layers, cfg.num_value_heads, cfg.key_head_dim,
                                     cfg.value_head_dim, dtype=torch.float32, device=device)
        self.slots: dict[str, int] = {}  # request id -> its slot
        self.free = list(range(max_requests - 1, -1, -1))

    def for_step(self, requests: Iterable[tuple[str, int, int]], preempted: Iterable[str] = ()) -> StateMetadata:
        """(request id, start position, new tokens) of each request in batch order; `preempted`:
        the requests the step's scheduling preempted, whose states are void."""
        for request_id in preempted:
            self.remove(request_id)
        rows: list[tuple[int, int]] = []
        slots: list[int] = []
        row = num_decodes = 0
        for request_id, start_pos, num_tokens in requests:
            slot = self.slots.get(request_id)
            if slot is None or start_pos == 0:
                if start_pos != 0:
                    raise RuntimeError(f"request {request_id!r} continues at position {start_pos} "
                                       "without the linear-attention state of the tokens before")
                slot = self._take(request_id)
            num_decodes += num_tokens == 1 and num_decodes == len(rows)
            rows.append((row, row + num_tokens))
            slots.append(slot)
            row += num_tokens
        decode_slots = torch.tensor(slots[:num_decodes], dtype=torch.long, device=self.device)
        return StateMetadata(self, rows, slots, num_decodes, decode_slots)

    def remove(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)

    def _take(self, request_id: str) -> int:
        slot = self.slots.get(request_id)
        if slot is None:
            if not self.free:
                raise RuntimeError(f"no linear-attention state slot is free for request {request_id!r}: "
                                   f"{len(self.slots)} requests hold them")
            slot = self.slots[request_id] = self.free.pop()
        self.conv[slot].zero_()
        self.recurrent[slot].zero_()
        return slot


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, then the gate's SiLU (in float32)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer (its checkpoint's `linear_attn`): projections in, a short
    causal convolution over q, k and v, the gated delta rule per request, a gated norm, out."""

    def __init__(self, cfg: LinearAttentionConfig, hidden_size: int, eps: float, index: int):
        super().__init__()
        self.cfg = cfg
        self.index = index  # among the linear-attention layers: its row of each request's state
        key_dim, value_dim = cfg.num_key_heads * cfg.key_head_dim, cfg.num_value_heads * cfg.value_head_dim
        self.in_proj_qkv = nn.Linear(hidden_size, 2 * key_dim + value_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, cfg.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, cfg.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(cfg.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.num_value_heads))
        self.norm = GatedRMSNorm(cfg.value_head_dim, eps)
        self.out_proj = nn.Linear(value_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope, kv_cache, meta: StateMetadata, lora=None) -> torch.Tensor:  # [T, hidden]
        cfg = self.cfg
        mixed = self.in_proj_qkv(x)  # [T, conv_dim]
        z = self.in_proj_z(x).view(len(x), cfg.num_value_heads, cfg.value_head_dim)
        beta = torch.sigmoid(self.in_proj_b(x)).float()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [T, Hv], log decay
        out = torch.empty(len(x), cfg.num_value_heads, cfg.value_head_dim, dtype=x.dtype, device=x.device)
        states, d = meta.states, meta.num_decodes
        if d:
            out[:d] = self._decode(mixed[:d], g[:d], beta[:d], states, meta.decode_slots)
        for (start, end), slot in zip(meta.rows[d:], meta.slots[d:], strict=True):
            qkv = self._convolve(mixed[start:end], states.conv[slot, self.index])
            q, k, v = self._heads(qkv)
            out[start:end] = gated_delta_rule(q, k, v, g[start:end], beta[start:end], states.recurrent[slot, self.index])
        core = self.norm(out, z).reshape(len(x), -1)
        return self.out_proj(core)

    def _decode(self, rows: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: LinearStates,
                slots: torch.Tensor) -> torch.Tensor:  # [d, Hv, Dv] float32
        """One new token of each of d requests, together: the convolution over each one's last
        inputs, then one step of the delta rule on each one's state."""
        inputs = torch.cat((states.conv[slots, self.index], rows[:, :, None]), dim=2)  # [d, conv_dim, kernel]
        states.conv[slots, self.index] = inputs[:, :, 1:]
        qkv = F.silu(F.conv1d(inputs, self.conv1d.weight, groups=self.cfg.conv_dim)[:, :, 0])  # the d requests as a batch
        q, k, v = self._heads(qkv)  # [d, Hv, D]
        s = states.recurrent[slots, self.index].mul_(g.exp()[..., None, None])  # [d, Hv, Dk, Dv], decayed
        written = (v - (k[..., None, :] @ s)[..., 0, :]) * beta[..., None]  # [d, Hv, Dv]
        flat = s.view(-1, *s.shape[2:])
        flat.baddbmm_(k.reshape(-1, k.shape[-1], 1), written.reshape(len(flat), 1, -1))  # s += k written^T
        states.recurrent[slots, self.index] = s
        return (q[..., None, :] @ s)[..., 0, :]

    def _convolve(self, rows: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """The causal depthwise convolution (then SiLU) over a request's new rows [n, conv_dim],
        after the inputs its state keeps; the state then keeps the last of them."""
        inputs = torch.cat((conv_state, rows.t()), dim=1)  # [conv_dim, kernel - 1 + n]
        conv_state.copy_(inputs[:, inputs.shape[1] - conv_state.shape[1]:])
        out = F.conv1d(inputs[None], self.conv1d.weight, groups=self.cfg.conv_dim)[0]  # [conv_dim, n]
        return F.silu(out).t()

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k [n, Hv, Dk] (each key head serving its value heads), float32, L2-normalized,
        q scaled; v [n, Hv, Dv] float32."""
        cfg = self.cfg
        key_dim = cfg.num_key_heads * cfg.key_head_dim
        q, k, v = qkv.float().split([key_dim, key_dim, qkv.shape[1] - 2 * key_dim], dim=1)
        repeat = cfg.num_value_heads // cfg.num_key_heads
        q, k = (t.view(len(t), cfg.num_key_heads, cfg.key_head_dim).repeat_interleave(repeat, dim=1) for t in (q, k))
        q, k = (t * torch.rsqrt(t.square().sum(-1, keepdim=True) + 1e-6) for t in (q, k))
        return q * cfg.key_head_dim**-0.5, k, v.view(len(v), cfg.num_value_heads, cfg.value_head_dim)


def gated_delta_rule(
    q: torch.Tensor,  # [n, H, Dk] float32, normalized and scaled
    k: torch.Tensor,  # [n, H, Dk]
    v: torch.Tensor,  # [n, H, Dv]
    g: torch.Tensor,  # [n, H] log decay (<= 0)
    beta: torch.Tensor,  # [n, H]
    state: torch.Tensor,  # [H, Dk, Dv] float32, updated in place
) -> torch.Tensor:  # [n, H, Dv] float32
    """A request's new tokens through the gated delta rule, CHUNK tokens at a time, from
    `state` (the tokens before), which ends holding the state after the last."""
    outputs = []
    s = state
    for start in range(0, len(q), CHUNK):
        chunk = slice(start, start + CHUNK)
        o, s = _chunk(q[chunk].transpose(0, 1), k[chunk].transpose(0, 1), v[chunk].transpose(0, 1),
                      g[chunk].t(), beta[chunk].t(), s)
        outputs.append(o.transpose(0, 1))
    state.copy_(s)
    return torch.cat(outputs)


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:  # q, k, v [H, C, D]; g, beta [H, C]; s [H, Dk, Dv]
    """One chunk in closed form. With A_t the decay from the chunk's start to t (inclusive) and
    D_tj = A_t / A_j, the values written u_t = beta_t (v_t - A_t S0^T k_t - sum_{j<t} D_tj
    (k_t . k_j) u_j) solve (I + L) U = beta V - beta A K S0, L strictly lower; then
    o_t = A_t S0^T q_t + sum_{j<=t} D_tj (q_t . k_j) u_j and S_C = A_C S0 + sum_j D_Cj k_j u_j^T."""
    size = q.shape[1]
    log_a = g.cumsum(-1)  # [H, C]
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = (log_a[:, :, None] - log_a[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # D, 0 above
    a = log_a.exp()[..., None]  # [H, C, 1]
    strict = (beta[..., None] * (k @ k.transpose(1, 2)) * decay).tril(-1)  # L
    system = strict + torch.eye(size, device=q.device)
    rhs = beta[..., None] * (v - (a * k) @ s)  # [H, C, Dv]
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    o = (a * q) @ s + ((q @ k.transpose(1, 2)) * decay) @ u
    tail = (log_a[:, -1:] - log_a).exp()[..., None]  # D_Cj [H, C, 1]
    s = log_a[:, -1, None, None].exp() * s + (k * tail).transpose(1, 2) @ u
    return o, s


def grouped_projections(weights: Iterable[tuple[str, torch.Tensor]], cfg: LinearAttentionConfig
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-Next's checkpoints: its linear layers' in_proj_qkvz rows come grouped by key head
    (the head's q, its k, then the v and z of the value heads it serves), and in_proj_ba's
    likewise (b, then a): regrouped as Qwen3.5 keeps them, in_proj_qkv (every q, every k,
    every v), in_proj_z, in_proj_b and in_proj_a."""
    per_key = cfg.num_value_heads // cfg.num_key_heads
    for name, tensor in weights:
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            groups = tensor.view(cfg.num_key_heads, -1, tensor.shape[-1])
            q, k, v, z = groups.split([cfg.key_head_dim, cfg.key_head_dim, per_key * cfg.value_head_dim,
                                       per_key * cfg.value_head_dim], dim=1)
            flat = [t.reshape(-1, tensor.shape[-1]) for t in (q, k, v, z)]
            yield name.replace("in_proj_qkvz", "in_proj_qkv"), torch.cat(flat[:3])
            yield name.replace("in_proj_qkvz", "in_proj_z"), flat[3]
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            b, a = tensor.view(cfg.num_key_heads, 2 * per_key, -1).split(per_key, dim=1)
            yield name.replace("in_proj_ba", "in_proj_b"), b.reshape(-1, tensor.shape[-1])
            yield name.replace("in_proj_ba", "in_proj_a"), a.reshape(-1, tensor.shape[-1])
        else:
            yield name, tensor
