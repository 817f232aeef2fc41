"""Gated DeltaNet, the linear attention of Qwen3.5's hybrid layers (three of every four), Mamba2
(Granite 4.0-H's), and the per-request state they keep in place of a KV cache.

Each such layer keeps, for every running request, a fixed-size state: the last
`conv_kernel - 1` inputs of its short causal convolution, and one recurrent matrix
[key_head_dim, value_head_dim] per value head (float32). A token updates it by the gated
delta rule,

    S <- a S + k (beta (v - a S^T k))^T,    a = exp(g),    o = S^T q,

with q and k L2-normalized and q scaled by key_head_dim ** -0.5. A chunk of tokens is
computed at once in its closed form: within the chunk the values written, u, solve a unit
lower-triangular system, and the outputs and the final state follow by matrix products
(the DeltaNet papers' "WY" form). A step's decodes run together, one recurrence step over
their states gathered from their slots, and so do the rows of short runs (a decode with its
guesses, STEPPED_ROWS or fewer), a token at a time. Mamba2's state space recurrence is the same rule
without its delta (Mamba2Mixer), S <- a S + k v^T: the values written are v themselves.

The state depends on every token before, so blocks of keys and values cannot restore it: the
prefix cache keeps states too, in slots of their own beside the requests' (`saved_conv`,
`saved_recurrent`), each the state after a boundary the scheduler names (a multiple of
`state_interval` tokens, worker.core.block_manager). A step saves a request's state at each
boundary its tokens pass (a prefill splits its chunks there), and a request served from the
cache starts from the state saved where the hit ends, as does a preempted one whose
boundaries are still kept (else it recomputes from its first token). A step that checks
guesses saves the state after its known tokens in the request's spare, and the engine rewinds
to it where a guess was wrong (the guesses kept are computed again, in front of the next
step's guesses). The n > 1 completions
of a prompt start from the state its first saved where they fork (each computes the prompt
where no state is kept). Plain torch, but on the kernel path (CUDA): there every request's rows
go through the rule in one Triton kernel per layer, a token at a time (kernels.recurrent), and
the decodes' convolution in another, each over the states in their slots.

LoRA adapters add to each projection by name (`lora_slots`); under tensor parallelism a rank
holds some key heads and the value heads that read them (their part of every state), and
out_proj's partial outputs are summed (`reduce`); KV offloading's host tier keeps saved states
evicted from their slots (`allocate_host`, `swap`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from worker.model_executor.models.config import LinearAttentionConfig

if TYPE_CHECKING:
    from worker.model_executor.lora_slots import LoRAMapping, LoRASlots

CHUNK = 64  # tokens solved together in a prefill
# the torch path runs a request of at most this many rows (a decode with its guesses, a short
# chunk) a token at a time, together with the others such, rather than solving it alone, when
# they are at least as many as the steps that takes (a batch of guessing requests)
STEPPED_ROWS = 8


@dataclass
class StateMetadata:
    """A step's requests in the linear-attention layers: each one's rows of the flat batch, its
    slot of the states, and the saved slots its state is copied to after some of its rows
    ((rows, saved slot) each); the first `num_decodes` are decodes (a row each), run together."""

    states: LinearStates
    rows: list[tuple[int, int]]
    slots: list[int]
    saves: list[tuple[tuple[int, int], ...]]
    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes] int64
    decode_saves: tuple[torch.Tensor, torch.Tensor] | None  # the decodes that save: their slots, the saved slots

    @cached_property
    def stepped(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]],
                               list[int]]:
        """The torch path's split of the requests (made once, for every layer): the decodes and
        (where they are at least as many as the rows of the longest) the others of at most
        STEPPED_ROWS rows, as a run of steps of one row each, every such request's row t in
        step t (its rows, their slots, and the (slot, saved slot) copies after it, None if
        none); and the others, by index, each solved alone."""
        short = [i for i in range(len(self.rows))
                 if self.rows[i][1] - self.rows[i][0] <= STEPPED_ROWS and all(n for n, _ in self.saves[i])]
        longest = max((self.rows[i][1] - self.rows[i][0] for i in short), default=0)
        if len(short) < longest:  # fewer runs than steps: each solved alone costs less (the decodes still step)
            short = [i for i in short if self.rows[i][1] - self.rows[i][0] == 1]
            longest = min(len(short), 1)
        steps = []
        device = self.states.device
        for t in range(longest):
            active = [i for i in short if self.rows[i][0] + t < self.rows[i][1]]
            copies = [(self.slots[i], target) for i in active for n, target in self.saves[i] if n == t + 1]
            steps.append((torch.tensor([self.rows[i][0] + t for i in active], device=device),
                          torch.tensor([self.slots[i] for i in active], device=device),
                          (torch.tensor([c[0] for c in copies], device=device),
                           torch.tensor([c[1] for c in copies], device=device)) if copies else None))
        alone = [i for i in range(len(self.rows)) if i not in short]
        return steps, alone

    @cached_property
    def scan(self) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """The step as the kernel path's `gated_delta_scan` takes it (made once, for every
        layer): each request's slot, its first row and the rows' end (int32), and the saves
        (first of each request's and their end, rows before each, saved slots), None if none."""
        states = self.states
        if self.num_decodes == len(self.rows):  # (a decode graph's slots are its static buffer)
            slots, starts = self.decode_slots, states.row_starts[:len(self.rows) + 1]
        else:
            slots = torch.tensor(self.slots, dtype=torch.long, device=states.device)
            starts = torch.tensor([0] + [end for _, end in self.rows], dtype=torch.int32, device=states.device)
        if not any(self.saves):
            return slots, starts, None
        counts = [len(request_saves) for request_saves in self.saves]
        flat = [save for request_saves in self.saves for save in sorted(request_saves)]  # each request's in row order
        return slots, starts, (torch.tensor([0, *accumulate(counts)], dtype=torch.int32, device=states.device),
                               torch.tensor([n for n, _ in flat], dtype=torch.int32, device=states.device),
                               torch.tensor([target for _, target in flat], dtype=torch.long, device=states.device))


# (request id, start position, new tokens, saved slot it starts from, (tokens before, saved
# slot) of the states it saves, guessed tokens its new tokens end with) of a request in a step
StepRequest = tuple[str, int, int, int | None, tuple[tuple[int, int], ...], int]


class LinearStates:
    """Every running request's state in every linear-attention layer, a slot each of
    `max_requests` (the scheduler runs no more at once): the last inputs of the convolution
    [slots, layers, conv_dim, conv_kernel - 1] in the model's dtype, the recurrent matrices
    [slots, layers, value heads, key_head_dim, value_head_dim] in float32. A request takes a
    slot when its first chunk runs (again when it starts over after a preemption), zeroed or
    copied from the saved state it starts from, and gives it back when it ends or is
    preempted. The prefix cache's saved states, `num_saved` of them (`allocate_saved`), are
    laid out alike, followed by a spare per request slot: a step that checks guesses saves the
    state after the request's known tokens there (its last token, after the guesses kept
    last time, which it computes again), which `rewind` takes back when a guess was wrong. One slot more, zeroed, is the padding rows' of a decode graph (worker.model_executor.cuda_graphs),
    which write only there. (Allocated empty: on the CPU the memory of slots never used is
    never touched.)"""

    def __init__(self, cfg: LinearAttentionConfig, num_layers: int, max_requests: int, dtype: torch.dtype,
                 device: torch.device):
        self.cfg, self.device = cfg, device
        self.max_requests = self.padding_slot = max_requests
        self.conv = torch.empty(max_requests + 1, num_layers, cfg.conv_dim, cfg.conv_kernel - 1, dtype=dtype,
                                device=device)
        self.recurrent = torch.empty(max_requests + 1, num_layers, cfg.num_value_heads, cfg.key_head_dim,
                                     cfg.value_head_dim, dtype=torch.float32, device=device)
        self.conv[self.padding_slot].zero_()
        self.recurrent[self.padding_slot].zero_()
        self.row_starts = torch.arange(max_requests + 2, dtype=torch.int32, device=device)  # a decode step's rows
        self.slots: dict[str, int] = {}  # request id -> its slot
        self.free = list(range(max_requests - 1, -1, -1))
        self.num_saved = self.num_host = 0
        self.allocate_saved(0)

    @staticmethod
    def request_bytes(cfg: LinearAttentionConfig, num_layers: int, dtype: torch.dtype) -> int:
        """One request's state, every layer's: its convolution's last inputs (in `dtype`) and
        its recurrent matrices (float32)."""
        conv = cfg.conv_dim * (cfg.conv_kernel - 1) * dtype.itemsize
        recurrent = cfg.num_value_heads * cfg.key_head_dim * cfg.value_head_dim * torch.float32.itemsize
        return num_layers * (conv + recurrent)

    @property
    def state_bytes(self) -> int:
        """One request's state, every layer's."""
        return self.request_bytes(self.cfg, self.conv.shape[1], self.conv.dtype)

    def allocate_saved(self, count: int, spares: bool = False) -> int:
        """`count` saved states for the prefix cache, and after them, where `spares`
        (speculative decoding), the requests' spares; how many states that is."""
        self.num_saved = count
        total = count + (self.max_requests if spares else 0)
        self.saved_conv = self.conv.new_empty(total, *self.conv.shape[1:])
        self.saved_recurrent = self.recurrent.new_empty(total, *self.recurrent.shape[1:])
        return total

    def allocate_host(self, count: int, pinned: bool) -> None:
        """KV offloading's host slots for `count` saved states (pinned beside a GPU)."""
        self.num_host = count
        self.host_conv = torch.empty(count, *self.conv.shape[1:], dtype=self.conv.dtype, pin_memory=pinned)
        self.host_recurrent = torch.empty(count, *self.recurrent.shape[1:], dtype=torch.float32, pin_memory=pinned)

    def swap(self, out: list[tuple[int, int]], back: list[tuple[int, int]]) -> None:
        """Saved states out to host slots ((saved slot, host slot) each), then host slots back
        into saved slots ((host slot, saved slot) each), before the step runs."""
        if out:
            saved, host = [s for s, _ in out], [h for _, h in out]
            self.host_conv[host] = self.saved_conv[saved].cpu()
            self.host_recurrent[host] = self.saved_recurrent[saved].cpu()
        if back:
            host, saved = [h for h, _ in back], [s for _, s in back]
            self.saved_conv[saved] = self.host_conv[host].to(self.device, non_blocking=True)
            self.saved_recurrent[saved] = self.host_recurrent[host].to(self.device, non_blocking=True)

    def rewind(self, request_id: str) -> None:
        """The request's state back to the one after the known tokens of its last step: the
        guesses after them were not all right."""
        slot = self.slots.get(request_id)
        if slot is None:  # (it left the step: aborted)
            return
        self.conv[slot] = self.saved_conv[self.num_saved + slot]
        self.recurrent[slot] = self.saved_recurrent[self.num_saved + slot]

    def for_graph(self, slots: torch.Tensor) -> StateMetadata:
        """A decode graph's: every row a decode, of the slot in `slots` (a static buffer)."""
        n = len(slots)
        return StateMetadata(self, [(i, i + 1) for i in range(n)], [self.padding_slot] * n, [()] * n, n, slots, None)

    def holds(self, request_id: str) -> bool:
        return request_id in self.slots

    def slot_of(self, request_id: str) -> int:
        return self.slots[request_id]

    def save_whole(self, slot: int, saved: int) -> None:
        """A slot's state, every layer's, into saved slot `saved` (after a decode graph)."""
        self.saved_conv[saved] = self.conv[slot]
        self.saved_recurrent[saved] = self.recurrent[slot]

    def for_step(self, requests: Iterable[StepRequest], preempted: Iterable[str] = ()) -> StateMetadata:
        """Each request of the step in batch order (StepRequest); `preempted`: the requests the
        step's scheduling preempted, whose states are void."""
        for request_id in preempted:
            self.remove(request_id)
        rows: list[tuple[int, int]] = []
        slots: list[int] = []
        saves: list[tuple[tuple[int, int], ...]] = []
        row = num_decodes = 0
        for request_id, start_pos, num_tokens, restore, saved, num_drafts in requests:
            slot = self.slots.get(request_id)
            if slot is None or start_pos == 0 or restore is not None:
                if start_pos != 0 and restore is None:
                    raise RuntimeError(f"request {request_id!r} continues at position {start_pos} "
                                       "without the linear-attention state of the tokens before")
                slot = self._take(request_id, restore)
            num_decodes += num_tokens == 1 and num_decodes == len(rows)
            rows.append((row, row + num_tokens))
            slots.append(slot)
            spare = ((num_tokens - num_drafts, self.num_saved + slot),) if num_drafts else ()  # (after the known rows)
            saves.append(tuple((before - start_pos, saved_slot) for before, saved_slot in saved) + spare)
            row += num_tokens
        decode_slots = torch.tensor(slots[:num_decodes], dtype=torch.long, device=self.device)
        decode_saves = None
        if any(saves[:num_decodes]):  # (a decode saves after its one row)
            pairs = [(slot, saved[0][1]) for slot, saved in zip(slots[:num_decodes], saves[:num_decodes], strict=True) if saved]
            decode_saves = (torch.tensor([p[0] for p in pairs], device=self.device),
                            torch.tensor([p[1] for p in pairs], device=self.device))
        return StateMetadata(self, rows, slots, saves, num_decodes, decode_slots, decode_saves)

    def remove(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)

    def _take(self, request_id: str, restore: int | None) -> int:
        slot = self.slots.get(request_id)
        if slot is None:
            if not self.free:
                raise RuntimeError(f"no linear-attention state slot is free for request {request_id!r}: "
                                   f"{len(self.slots)} requests hold them")
            slot = self.slots[request_id] = self.free.pop()
        if restore is None:
            self.conv[slot].zero_()
            self.recurrent[slot].zero_()
        else:
            self.conv[slot] = self.saved_conv[restore]
            self.recurrent[slot] = self.saved_recurrent[restore]
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


class StateMixer(nn.Module):
    """What a layer with a per-request state does whatever its rule: a short causal convolution
    over its inputs, then the recurrence per request from its slot (a prefill's chunks solved at
    once, a step's decodes and short runs a token at a time together), saving the states the
    step names."""

    conv1d: nn.Conv1d

    def __init__(self, cfg: LinearAttentionConfig, index: int, use_kernels: bool):
        super().__init__()
        self.cfg = cfg
        self.index = index  # among the layers with a state: its row of each request's state
        self.use_kernels = use_kernels  # the rule and the decodes' convolution in Triton kernels (the CUDA path)
        self.lora_slots: dict[str, LoRASlots] = {}  # the projections' adapter slots by name, where LoRA is enabled
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallelism's sum over the ranks

    def _reduced(self, out: torch.Tensor) -> torch.Tensor:
        """out_proj's output summed over the tensor-parallel ranks (each holds some heads)."""
        return out if self.reduce is None else self.reduce(out)

    def _project(self, name: str, x: torch.Tensor, lora: LoRAMapping | None) -> torch.Tensor:
        """Projection `name` of x, plus each row's adapter delta where a request has one."""
        y = getattr(self, name)(x)
        return y if lora is None else lora.add(y, x, self.lora_slots.get(name))

    def _mix(self, inputs: torch.Tensor, meta: StateMetadata, heads: Heads) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule over the convolution of `inputs` [T, conv_dim]: its outputs [T, Hv, Dv]
        (float32), and the convolution's [T, conv_dim]. `heads` makes q, k, v, the log decay g
        and beta (None: no delta) of some rows from their convolution."""
        if self.use_kernels:
            return self._mix_kernels(inputs, meta, heads)
        cfg = self.cfg
        out = torch.empty(len(inputs), cfg.num_value_heads, cfg.value_head_dim, device=inputs.device)
        convolved = torch.empty_like(inputs)
        states = meta.states
        steps, alone = meta.stepped
        for rows, slots, copies in steps:  # the decodes' and short requests' rows, a token at a time
            convolved[rows], out[rows] = self._decode(inputs[rows], states, slots, heads, rows)
            if copies is not None:
                slots, saved = copies
                states.saved_conv[saved, self.index] = states.conv[slots, self.index]
                states.saved_recurrent[saved, self.index] = states.recurrent[slots, self.index]
        for i in alone:
            (start, end), slot, saves = meta.rows[i], meta.slots[i], meta.saves[i]
            convolved[start:end] = self._convolve_request(inputs, meta, start, end, slot, saves)
            q, k, v, g, beta = heads(convolved[start:end], slice(start, end))
            stops: dict[int, list[torch.Tensor]] = {}
            for n, target in saves:
                stops.setdefault(n, []).append(states.saved_recurrent[target, self.index])
            out[start:end] = gated_delta_rule(q, k, v, g, beta, states.recurrent[slot, self.index], stops)
        return out, convolved

    def _decode(self, rows: torch.Tensor, states: LinearStates, slots: torch.Tensor, heads: Heads,
                where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [d, conv_dim], [d, Hv, Dv] float32
        """One new token of each of d requests (`rows`, the batch's rows `where`), together:
        the convolution over each one's last inputs, then one step of the rule on each one's
        state."""
        inputs = torch.cat((states.conv[slots, self.index], rows[:, :, None]), dim=2)  # [d, conv_dim, kernel]
        states.conv[slots, self.index] = inputs[:, :, 1:]
        convolved = F.silu(F.conv1d(inputs, self.conv1d.weight, self.conv1d.bias, groups=self.cfg.conv_dim)[:, :, 0])
        q, k, v, g, beta = heads(convolved, where)  # the d requests as a batch: [d, Hv, D]
        s = states.recurrent[slots, self.index].mul_(g.exp()[..., None, None])  # [d, Hv, Dk, Dv], decayed
        written = v if beta is None else (v - (k[..., None, :] @ s)[..., 0, :]) * beta[..., None]  # [d, Hv, Dv]
        flat = s.view(-1, *s.shape[2:])
        flat.baddbmm_(k.reshape(-1, k.shape[-1], 1), written.reshape(len(flat), 1, -1))  # s += k written^T
        states.recurrent[slots, self.index] = s
        return convolved, (q[..., None, :] @ s)[..., 0, :]

    def _mix_kernels(self, inputs: torch.Tensor, meta: StateMetadata, heads: Heads
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """_mix on the kernel path: the decodes' convolution in one kernel (the prefills' in
        torch, request by request), then every request's rows through the rule in one launch
        (kernels.recurrent), which saves the recurrent states the step names."""
        import kernels  # triton is loaded only where the kernel path runs

        states, d = meta.states, meta.num_decodes
        convolved = torch.empty_like(inputs)
        if d:
            convolved[:d] = kernels.causal_conv1d_step(inputs[:d], states.conv[:, self.index], meta.decode_slots,
                                                       self.conv1d.weight[:, 0], self.conv1d.bias)
            if meta.decode_saves is not None:
                slots, saved = meta.decode_saves
                states.saved_conv[saved, self.index] = states.conv[slots, self.index]
        for (start, end), slot, saves in zip(meta.rows[d:], meta.slots[d:], meta.saves[d:], strict=True):
            convolved[start:end] = self._convolve_request(inputs, meta, start, end, slot, saves)
        q, k, v, g, beta = heads(convolved, slice(0, len(inputs)))
        slots, starts, kept = meta.scan
        saving = None if kept is None else kernels.StateSaves(states.saved_recurrent[:, self.index], *kept)
        return kernels.gated_delta_scan(q, k, v, g, beta, states.recurrent[:, self.index], slots, starts, saving), convolved

    def _convolve_request(self, inputs: torch.Tensor, meta: StateMetadata, start: int, end: int, slot: int,
                          saves: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """A request's rows start:end of `inputs` through _convolve from its slot, saving the
        convolution's states the step names."""
        states = meta.states
        return self._convolve(inputs[start:end], states.conv[slot, self.index],
                              [states.saved_conv[target, self.index] for _, target in saves], [n for n, _ in saves])

    def _convolve(self, rows: torch.Tensor, conv_state: torch.Tensor, saved: Sequence[torch.Tensor] = (),
                  after: Sequence[int] = ()) -> torch.Tensor:
        """The causal depthwise convolution (then SiLU) over a request's new rows [n, conv_dim],
        after the inputs its state keeps; the state then keeps the last of them, and each of
        `saved` those before row `after[i]`."""
        inputs = torch.cat((conv_state, rows.t()), dim=1)  # [conv_dim, kernel - 1 + n]
        for state, num_rows in zip(saved, after, strict=True):
            state.copy_(inputs[:, num_rows:num_rows + conv_state.shape[1]])
        conv_state.copy_(inputs[:, inputs.shape[1] - conv_state.shape[1]:])
        out = F.conv1d(inputs[None], self.conv1d.weight, self.conv1d.bias, groups=self.cfg.conv_dim)[0]  # [conv_dim, n]
        return F.silu(out).t()


class GatedDeltaNet(StateMixer):
    """One linear-attention layer (its checkpoint's `linear_attn`): projections in, a short
    causal convolution over q, k and v, the gated delta rule per request, a gated norm, out."""

    def __init__(self, cfg: LinearAttentionConfig, hidden_size: int, eps: float, index: int,
                 use_kernels: bool = False):
        super().__init__(cfg, index, use_kernels)
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

    def forward(self, x: torch.Tensor, rope, kv_cache, meta: StateMetadata, lora: LoRAMapping | None = None
                ) -> torch.Tensor:  # [T, hidden]
        cfg = self.cfg
        z = self._project("in_proj_z", x, lora).view(len(x), cfg.num_value_heads, cfg.value_head_dim)
        beta = torch.sigmoid(self._project("in_proj_b", x, lora)).float()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self._project("in_proj_a", x, lora).float() + self.dt_bias)  # log decay

        def heads(qkv: torch.Tensor, rows: slice | torch.Tensor) -> HeadsOut:
            return *self._heads(qkv), g[rows], beta[rows]

        out, _ = self._mix(self._project("in_proj_qkv", x, lora), meta, heads)
        core = self.norm(out.to(x.dtype), z).reshape(len(x), -1)
        return self._reduced(self._project("out_proj", core, lora))

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


class GroupedGatedRMSNorm(nn.Module):
    """Mamba2's gated norm: x times the gate's SiLU, then RMSNorm over each of `groups` equal
    parts of the features (in float32)."""

    def __init__(self, size: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups, self.eps = groups, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [T, size] each
        h = (x.float() * F.silu(gate.float())).view(len(x), self.groups, -1)
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * h.view(len(x), -1).to(self.weight.dtype)


class Mamba2Mixer(StateMixer):
    """One Mamba2 layer (Granite 4.0-H's `mamba`): in_proj makes the gate z, the convolution's
    inputs (x, B, C) and each head's time step dt; after the convolution the state space
    recurrence runs per head, S <- exp(dt A) S + B (dt x)^T, y = S^T C + D x: the gated rule
    without its delta, with k = B, v = dt x and q = C (B and C shared by the heads of a group).
    Then the grouped gated norm, and out_proj."""

    def __init__(self, cfg: LinearAttentionConfig, hidden_size: int, eps: float, index: int,
                 use_kernels: bool = False):
        super().__init__(cfg, index, use_kernels)
        self.inner = cfg.num_value_heads * cfg.value_head_dim
        self.in_proj = nn.Linear(hidden_size, self.inner + cfg.conv_dim + cfg.num_value_heads, bias=cfg.proj_bias)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(cfg.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.num_value_heads))
        self.D = nn.Parameter(torch.ones(cfg.num_value_heads))
        self.norm = GroupedGatedRMSNorm(self.inner, cfg.num_key_heads, eps)
        self.out_proj = nn.Linear(self.inner, hidden_size, bias=cfg.proj_bias)

    def forward(self, x: torch.Tensor, rope, kv_cache, meta: StateMetadata, lora: LoRAMapping | None = None
                ) -> torch.Tensor:  # [T, hidden]
        cfg = self.cfg
        heads_, dv = cfg.num_value_heads, cfg.value_head_dim
        z, inputs, dt = self._project("in_proj", x, lora).split([self.inner, cfg.conv_dim, heads_], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*cfg.dt_limit)  # [T, H]
        g = -self.A_log.float().exp() * dt  # log decay

        def heads(convolved: torch.Tensor, rows: slice | torch.Tensor) -> HeadsOut:
            xs, b, c = convolved.float().split([self.inner, cfg.num_key_heads * cfg.key_head_dim,
                                                cfg.num_key_heads * cfg.key_head_dim], dim=1)
            b, c = (t.view(len(t), cfg.num_key_heads, -1).repeat_interleave(heads_ // cfg.num_key_heads, dim=1)
                    for t in (b, c))
            return c, b, xs.view(len(xs), heads_, dv) * dt[rows, :, None], g[rows], None

        y, convolved = self._mix(inputs, meta, heads)
        y = y + self.D.float()[:, None] * convolved[:, :self.inner].float().view(len(x), heads_, dv)
        return self._reduced(self._project("out_proj", self.norm(y.view(len(x), -1), z).to(x.dtype), lora))


# (q, k, v, g, beta) of some rows: what StateMixer._mix's `heads` makes of their convolution
HeadsOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
Heads = Callable[[torch.Tensor, slice | torch.Tensor], HeadsOut]  # (rows: a slice, or their indices)


def gated_delta_rule(
    q: torch.Tensor,  # [n, H, Dk] float32, normalized and scaled
    k: torch.Tensor,  # [n, H, Dk]
    v: torch.Tensor,  # [n, H, Dv]
    g: torch.Tensor,  # [n, H] log decay (<= 0)
    beta: torch.Tensor | None,  # [n, H]; None: the gated rule without its delta (Mamba2's), u = v
    state: torch.Tensor,  # [H, Dk, Dv] float32, updated in place
    stops: Mapping[int, Sequence[torch.Tensor]] | None = None,
) -> torch.Tensor:  # [n, H, Dv] float32
    """A request's new tokens through the gated delta rule, CHUNK tokens at a time, from
    `state` (the tokens before), which ends holding the state after the last; `stops`: tensors
    that take the state after that many tokens (a chunk ends there)."""
    stops = stops or {}
    ends = sorted({*range(CHUNK, len(q), CHUNK), *stops, len(q)})
    outputs = []
    s = state
    start = 0
    for end in ends:
        chunk = slice(start, end)
        o, s = _chunk(q[chunk].transpose(0, 1), k[chunk].transpose(0, 1), v[chunk].transpose(0, 1),
                      g[chunk].t(), None if beta is None else beta[chunk].t(), s)
        outputs.append(o.transpose(0, 1))
        for stop in stops.get(end, ()):
            stop.copy_(s)
        start = end
    state.copy_(s)
    return torch.cat(outputs)


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None,
           s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # q, k, v [H, C, D]; g, beta [H, C]; s [H, Dk, Dv]
    """One chunk in closed form. With A_t the decay from the chunk's start to t (inclusive) and
    D_tj = A_t / A_j, the values written u_t = beta_t (v_t - A_t S0^T k_t - sum_{j<t} D_tj
    (k_t . k_j) u_j) solve (I + L) U = beta V - beta A K S0, L strictly lower (without the
    delta, u = v); then o_t = A_t S0^T q_t + sum_{j<=t} D_tj (q_t . k_j) u_j and
    S_C = A_C S0 + sum_j D_Cj k_j u_j^T."""
    size = q.shape[1]
    log_a = g.cumsum(-1)  # [H, C]
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = (log_a[:, :, None] - log_a[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # D, 0 above
    a = log_a.exp()[..., None]  # [H, C, 1]
    if beta is None:
        u = v
    else:
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
    per_key = cfg.num_value_heads // cfg.num_key_heads  # (a tensor-parallel rank's `cfg` holds some key heads)
    for name, tensor in weights:
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            groups = tensor.view(-1, 2 * (cfg.key_head_dim + per_key * cfg.value_head_dim), tensor.shape[-1])
            q, k, v, z = groups.split([cfg.key_head_dim, cfg.key_head_dim, per_key * cfg.value_head_dim,
                                       per_key * cfg.value_head_dim], dim=1)
            flat = [t.reshape(-1, tensor.shape[-1]) for t in (q, k, v, z)]
            yield name.replace("in_proj_qkvz", "in_proj_qkv"), torch.cat(flat[:3])
            yield name.replace("in_proj_qkvz", "in_proj_z"), flat[3]
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            b, a = tensor.view(-1, 2 * per_key, tensor.shape[-1]).split(per_key, dim=1)
            yield name.replace("in_proj_ba", "in_proj_b"), b.reshape(-1, tensor.shape[-1])
            yield name.replace("in_proj_ba", "in_proj_a"), a.reshape(-1, tensor.shape[-1])
        else:
            yield name, tensor
