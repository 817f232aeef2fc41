"""The layers that keep a state per request in place of a KV cache (Qwen3.5's Gated DeltaNet,
Mamba2), over every request of a step at once.

Each request's state lies in a slot of a pool the model keeps for every layer (worker's
LinearStates); the launchers take one layer's view of the pool, strided, and the slot of each
request, so no state is gathered or scattered around the kernels.

- `causal_conv1d_step`: a decode's new input row through the short depthwise causal
  convolution, after the last `kernel - 1` inputs the slot keeps, then SiLU; the slot then
  keeps the last inputs. The sum is taken in float32 and rounded to the activations' dtype
  before the SiLU, as the torch convolution does.
- `gated_delta_scan`: each request's rows (a decode's one, a prefill chunk's many) through the
  gated delta rule over the slot's recurrent matrix S [Dk, Dv] (float32), a token at a time:
  S <- a S + k u^T with a = exp(g) and u = beta (v - (a S)^T k), or u = v without the delta
  (beta None: Mamba2's state space rule); each row's output is S^T q. A program keeps a
  [Dk, BLOCK_V] tile of S in registers through its request's rows: it reads the state once,
  writes it once, and copies it out after the rows the step saves states at (`StateSaves`). The
  torch path reads a decode's state four times, and runs a prefill in chunks of 64 tokens
  (their closed form, a dozen launches each) request by request.
"""

from dataclasses import dataclass

import torch

from kernels._common import (
    cdiv,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_shape,
    next_power_of_2,
    tl,
    triton,
)

__all__ = ["StateSaves", "causal_conv1d_step", "causal_conv1d_step_ref", "gated_delta_scan", "gated_delta_scan_ref"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK_C = 256  # channels a convolution program takes


@triton.jit
def _conv_step_kernel(
    x_ptr,  # [rows, channels]: each row's new input
    state_ptr,  # [slots, channels, KERNEL - 1]: the inputs each slot keeps
    slots_ptr,  # [rows] int64
    weight_ptr,  # [channels, KERNEL]
    bias_ptr,  # [channels]; read only when HAS_BIAS
    out_ptr,  # [rows, channels]
    channels,
    stride_x,
    stride_state_slot,
    stride_state_channel,
    stride_weight,
    stride_out,
    KERNEL: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < channels
    slot = tl.load(slots_ptr + row)
    kept = state_ptr + slot * stride_state_slot + cols * stride_state_channel
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    new = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    for j in tl.static_range(KERNEL):
        if j < KERNEL - 1:
            value = tl.load(kept + j, mask=mask, other=0.0)
        else:
            value = new
        acc += tl.load(weight_ptr + cols * stride_weight + j, mask=mask, other=0.0).to(tl.float32) * value.to(
            tl.float32
        )
        if j > 0:  # the kept inputs move down one (column j - 1 was read an iteration ago)
            tl.store(kept + (j - 1), value.to(state_ptr.dtype.element_ty), mask=mask)
    acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _delta_scan_kernel(
    q_ptr,  # [rows, heads, KEY_DIM] float32
    k_ptr,  # [rows, heads, KEY_DIM] float32
    v_ptr,  # [rows, heads, VALUE_DIM] float32
    g_ptr,  # [rows, heads] float32: log decay
    beta_ptr,  # [rows, heads] float32; read only when DELTA
    state_ptr,  # [slots, heads, KEY_DIM, VALUE_DIM] float32
    slots_ptr,  # [requests] int64
    starts_ptr,  # [requests + 1] int32: each request's first row, then the rows' end
    saved_ptr,  # [saved slots, heads, KEY_DIM, VALUE_DIM] float32; written only when SAVES
    save_index_ptr,  # [requests + 1] int32: each request's first save, then the saves' end
    save_after_ptr,  # [saves] int32: the request's rows a save follows (ascending per request)
    save_slots_ptr,  # [saves] int64: the saved slot it goes to
    out_ptr,  # [rows, heads, VALUE_DIM] float32
    stride_q_row,
    stride_q_head,
    stride_k_row,
    stride_k_head,
    stride_v_row,
    stride_v_head,
    stride_g_row,
    stride_beta_row,
    stride_state_slot,
    stride_state_head,
    stride_state_key,
    stride_saved_slot,
    stride_saved_head,
    stride_saved_key,
    stride_out_row,
    stride_out_head,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    KEY_P: tl.constexpr,  # KEY_DIM rounded up to a power of two
    BLOCK_V: tl.constexpr,
    DELTA: tl.constexpr,
    SAVES: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    keys = tl.arange(0, KEY_P)
    values = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    key_mask = keys < KEY_DIM
    value_mask = values < VALUE_DIM
    tile_mask = key_mask[:, None] & value_mask[None, :]
    within = keys[:, None] * stride_state_key + values[None, :]
    tile = state_ptr + tl.load(slots_ptr + request) * stride_state_slot + head * stride_state_head + within
    s = tl.load(tile, mask=tile_mask, other=0.0)  # [KEY_P, BLOCK_V]
    first = tl.load(starts_ptr + request).to(tl.int64)
    end = tl.load(starts_ptr + request + 1).to(tl.int64)
    save = 0
    save_end = 0
    next_save = -1  # the row count the next save follows
    if SAVES:
        save = tl.load(save_index_ptr + request)
        save_end = tl.load(save_index_ptr + request + 1)
        next_save = tl.load(save_after_ptr + save, mask=save < save_end, other=-1)
    for row in range(first, end):
        q = tl.load(q_ptr + row * stride_q_row + head * stride_q_head + keys, mask=key_mask, other=0.0)
        k = tl.load(k_ptr + row * stride_k_row + head * stride_k_head + keys, mask=key_mask, other=0.0)
        v = tl.load(v_ptr + row * stride_v_row + head * stride_v_head + values, mask=value_mask, other=0.0)
        s *= tl.exp(tl.load(g_ptr + row * stride_g_row + head))
        if DELTA:
            beta = tl.load(beta_ptr + row * stride_beta_row + head)
            u = (v - tl.sum(k[:, None] * s, 0)) * beta
        else:
            u = v
        s += k[:, None] * u[None, :]
        out = tl.sum(q[:, None] * s, 0)
        tl.store(out_ptr + row * stride_out_row + head * stride_out_head + values, out, mask=value_mask)
        if SAVES:
            while next_save == row + 1 - first:
                target = tl.load(save_slots_ptr + save)
                tl.store(saved_ptr + target * stride_saved_slot + head * stride_saved_head + within, s,
                         mask=tile_mask)
                save += 1
                next_save = tl.load(save_after_ptr + save, mask=save < save_end, other=-1)
    tl.store(tile, s, mask=tile_mask)


def causal_conv1d_step(
    x: torch.Tensor,  # [rows, channels]
    conv_state: torch.Tensor,  # [slots, channels, kernel - 1], updated in place
    slots: torch.Tensor,  # [rows] int64
    weight: torch.Tensor,  # [channels, kernel]
    bias: torch.Tensor | None = None,  # [channels]
) -> torch.Tensor:  # [rows, channels]
    """SiLU of each row's depthwise causal convolution over the inputs its slot keeps and
    itself; the slot then keeps its last `kernel - 1` inputs."""
    check_dtype("x", x, _DTYPES)
    check_shape("x", x, (None, None))
    rows, channels = x.shape
    kernel = weight.shape[-1]
    check_shape("conv_state", conv_state, (None, channels, kernel - 1))
    check_dtype("conv_state", conv_state, (x.dtype,))
    check_shape("weight", weight, (channels, kernel))
    check_dtype("weight", weight, (x.dtype,))
    if bias is not None:
        check_shape("bias", bias, (channels,))
        check_dtype("bias", bias, (x.dtype,))
    _check_slots(slots, rows)
    for name, t in (("x", x), ("conv_state", conv_state), ("weight", weight)):
        check_last_dim_contiguous(name, t)
    check_device(_conv_step_kernel, x=x, conv_state=conv_state, slots=slots, weight=weight,
                 **({} if bias is None else {"bias": bias}))  # fmt: skip
    out = torch.empty_like(x)
    if rows:
        _conv_step_kernel[(rows, cdiv(channels, _BLOCK_C))](
            x, conv_state, slots, weight, weight if bias is None else bias, out, channels,
            x.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0), out.stride(0),
            KERNEL=kernel, BLOCK_C=_BLOCK_C, HAS_BIAS=bias is not None,
        )  # fmt: skip
    return out


@dataclass(frozen=True)
class StateSaves:
    """The states gated_delta_scan copies out: request i's are saves index[i] to index[i + 1],
    save j after `after[j]` of the request's rows (ascending, each at least 1), into slot
    `slots[j]` of `saved`."""

    saved: torch.Tensor  # [saved slots, heads, key_dim, value_dim] float32
    index: torch.Tensor  # [requests + 1] int32
    after: torch.Tensor  # [saves] int32
    slots: torch.Tensor  # [saves] int64

    def check(self, requests: int, state: torch.Tensor) -> None:
        check_shape("saves.saved", self.saved, (None, *state.shape[1:]))
        check_dtype("saves.saved", self.saved, (torch.float32,))
        check_last_dim_contiguous("saves.saved", self.saved)
        check_shape("saves.index", self.index, (requests + 1,))
        check_shape("saves.after", self.after, (len(self.slots),))
        for name, t, dtype in (("saves.index", self.index, torch.int32), ("saves.after", self.after, torch.int32),
                               ("saves.slots", self.slots, torch.int64)):  # fmt: skip
            check_dtype(name, t, (dtype,))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"saved": self.saved, "save_index": self.index, "save_after": self.after, "save_slots": self.slots}


def gated_delta_scan(
    q: torch.Tensor,  # [rows, heads, key_dim] float32
    k: torch.Tensor,  # [rows, heads, key_dim] float32
    v: torch.Tensor,  # [rows, heads, value_dim] float32
    g: torch.Tensor,  # [rows, heads] float32: log decay
    beta: torch.Tensor | None,  # [rows, heads] float32; None: the rule without its delta
    state: torch.Tensor,  # [slots, heads, key_dim, value_dim] float32, updated in place
    slots: torch.Tensor,  # [requests] int64
    starts: torch.Tensor,  # [requests + 1] int32: each request's first row, then the rows' end
    saves: StateSaves | None = None,
) -> torch.Tensor:  # [rows, heads, value_dim] float32
    """Each request's rows through the gated (delta) rule, a token at a time, from its slot of
    `state`, which ends holding the state after its last row; each row's output. `saves`: the
    states to copy out after some of a request's rows."""
    rows, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    check_shape("state", state, (None, heads, key_dim, value_dim))
    for name, t, shape in (("q", q, (rows, heads, key_dim)), ("k", k, (rows, heads, key_dim)),
                           ("v", v, (rows, heads, value_dim)), ("g", g, (rows, heads)),
                           ("beta", beta, (rows, heads)), ("state", state, None)):  # fmt: skip
        if t is None:
            continue
        check_dtype(name, t, (torch.float32,))
        if shape is not None:
            check_shape(name, t, shape)
        check_last_dim_contiguous(name, t)
    requests = len(slots)
    _check_slots(slots, requests)
    check_dtype("starts", starts, (torch.int32,))
    check_shape("starts", starts, (requests + 1,))
    if saves is not None:
        saves.check(requests, state)
    tensors = dict(q=q, k=k, v=v, g=g, state=state, slots=slots, starts=starts)
    check_device(_delta_scan_kernel, **tensors, **({} if beta is None else {"beta": beta}),
                 **({} if saves is None else saves.tensors()))  # fmt: skip
    out = q.new_empty(rows, heads, value_dim)
    block_v = min(next_power_of_2(value_dim), max(16, 8192 // next_power_of_2(key_dim)))
    if requests:
        beta_or_g = g if beta is None else beta
        saved, index, after, targets = (state, starts, starts, slots) if saves is None else (
            saves.saved, saves.index, saves.after, saves.slots)
        _delta_scan_kernel[(requests, heads, cdiv(value_dim, block_v))](
            q, k, v, g, beta_or_g, state, slots, starts, saved, index, after, targets, out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
            beta_or_g.stride(0), state.stride(0), state.stride(1), state.stride(2),
            saved.stride(0), saved.stride(1), saved.stride(2), out.stride(0), out.stride(1),
            KEY_DIM=key_dim, VALUE_DIM=value_dim, KEY_P=next_power_of_2(key_dim), BLOCK_V=block_v,
            DELTA=beta is not None, SAVES=saves is not None,
        )  # fmt: skip
    return out


def _check_slots(slots: torch.Tensor, rows: int) -> None:
    check_dtype("slots", slots, (torch.int64,))
    check_shape("slots", slots, (rows,))


def causal_conv1d_step_ref(
    x: torch.Tensor,  # [rows, channels]
    conv_state: torch.Tensor,  # [slots, channels, kernel - 1], updated in place
    slots: torch.Tensor,  # [rows] int64
    weight: torch.Tensor,  # [channels, kernel]
    bias: torch.Tensor | None = None,  # [channels]
) -> torch.Tensor:  # [rows, channels]
    """Plain torch, a row at a time."""
    out = torch.empty_like(x)
    for row, slot in enumerate(slots.tolist()):
        inputs = torch.cat((conv_state[slot], x[row, :, None]), dim=1).float()  # [channels, kernel]
        total = (inputs * weight.float()).sum(1) + (0 if bias is None else bias.float())
        out[row] = torch.nn.functional.silu(total.to(x.dtype).float()).to(x.dtype)
        conv_state[slot] = inputs[:, 1:].to(conv_state.dtype)
    return out


def gated_delta_scan_ref(
    q: torch.Tensor,  # [rows, heads, key_dim] float32
    k: torch.Tensor,
    v: torch.Tensor,  # [rows, heads, value_dim] float32
    g: torch.Tensor,  # [rows, heads] float32
    beta: torch.Tensor | None,  # [rows, heads] float32
    state: torch.Tensor,  # [slots, heads, key_dim, value_dim] float32, updated in place
    slots: torch.Tensor,  # [requests] int64
    starts: torch.Tensor,  # [requests + 1] int32
    saves: StateSaves | None = None,
) -> torch.Tensor:  # [rows, heads, value_dim] float32
    """Plain torch, a token at a time."""
    out = torch.empty_like(v)
    bounds = starts.tolist()
    for request, slot in enumerate(slots.tolist()):
        first = bounds[request]
        stops: dict[int, list[int]] = {}
        if saves is not None:
            todo = range(*saves.index[request:request + 2].tolist())
            for after, target in zip(saves.after[todo].tolist(), saves.slots[todo].tolist(), strict=True):
                stops.setdefault(first + after, []).append(target)
        s = state[slot]  # [heads, key_dim, value_dim]
        for row in range(first, bounds[request + 1]):
            s = s * g[row].exp()[:, None, None]
            u = v[row] if beta is None else beta[row, :, None] * (v[row] - (k[row, :, None, :] @ s)[:, 0])
            s = s + k[row, :, :, None] * u[:, None, :]
            out[row] = (q[row, :, None, :] @ s)[:, 0]
            for target in stops.get(row + 1, ()):
                assert saves is not None
                saves.saved[target] = s
        state[slot] = s
    return out
