"""Decode steps replayed from CUDA graphs, one captured per padded batch size.

A decode step launches about ten kernels per layer, each with a few microseconds of work at
small batches, so launching them costs more CPU time than the GPU spends running them. A
graph replays the whole forward with one launch. It replays fixed addresses and a fixed grid:

- every input lives in a static buffer sized for the largest captured batch;
- a batch is padded up to the nearest captured size, and its padding rows change nothing:
  slot -1 (the KV write skips it) and context length 0 (attention reads no key);
- attention is launched with `max_model_len` as its bound on context length, so its grid
  (and KV split count) holds for any batch of that size.

A model with per-request states (linear attention, Mamba2) reads each row's state slot from a
static buffer too; padding rows read and write a slot of their own. The states a decode saves
for the prefix cache are copied after the replay.

Only the model's forward is captured; logits and sampling run after it, on real rows only.
On CPU, where the triton backend runs only under TRITON_INTERPRET for tests, nothing is
captured: `run` makes the same padded call eagerly, so tests check all but the capture.
"""

from __future__ import annotations

import logging
import time

import torch

from worker.core.scheduler import ScheduledRequest
from worker.model_executor.attention import GroupedMetadata
from worker.model_executor.attention_triton import TritonMetadata
from worker.model_executor.models.linear_attention import LinearStates
from worker.model_executor.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512  # past this many sequences a decode step is long enough to launch eagerly


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to the first that holds max_num_seqs (at most 512)."""
    candidates = [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]
    smaller = [n for n in candidates if n < max_num_seqs]
    return smaller + [n for n in candidates if n >= max_num_seqs][:1]


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        layer_group: list[int] | None = None,  # each layer's KV group (None: one group)
        states: LinearStates | None = None,  # the per-request states of the layers in `state_layers`
        state_layers: frozenset[int] = frozenset(),
    ):
        self.model = model
        self.states, self.state_layers = states, state_layers
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        self.layer_group = layer_group or [0]
        num_groups = max(self.layer_group) + 1
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        # Padding state: as filled before capture and as left in rows past a batch.
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)  # [N]
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # [N]
        # a slot mapping and block tables per KV group
        self.slot_mapping = torch.full((num_groups, n), -1, dtype=torch.long, device=device)  # [G, N]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [N + 1], fixed
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)  # [N]
        self.block_tables = torch.zeros((num_groups, n, max_blocks), dtype=torch.int32, device=device)  # [G, N, max_blocks]
        if states is not None:
            self.state_slots = torch.full((n,), states.padding_slot, dtype=torch.long, device=device)  # [N]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> [size, hidden], written by replay
        self.num_steps: dict[int, int] = dict.fromkeys(self.sizes, 0)  # steps run at each size
        if device.type == "cuda":
            self._capture_all()

    def can_run(self, batch: list[ScheduledRequest]) -> bool:
        """Decodes only (no prompt logprobs to compute), and no more than the largest size; with
        states, of requests that hold theirs already (not one starting, from nothing or from a
        saved state)."""
        return 0 < len(batch) <= self.sizes[-1] and all(
            len(s.token_ids) == 1 and not s.prompt_logprobs and (self.states is None or self.states.holds(s.request_id))
            for s in batch
        )

    @torch.inference_mode()
    def run(self, batch: list[ScheduledRequest], tables: list[torch.Tensor],
            rope: list[int] | None = None) -> torch.Tensor:  # [B, hidden]
        """`tables`: the batch's block tables, a [B, width] host tensor per KV group, as wide as
        its longest context needs; `rope`: the rows' rotary positions where they are not their
        positions (M-RoPE)."""
        size = next(n for n in self.sizes if n >= len(batch))
        self.num_steps[size] += 1
        self._fill(batch, tables, size, rope)
        if size in self.graphs:
            self.graphs[size].replay()
            out = self.outputs[size][: len(batch)]
        else:
            out = self._forward(size)[: len(batch)]
        if self.states is not None:  # (a decode's saved state is the one it ends with)
            for s in batch:
                for _, saved in s.state_saves:
                    self.states.save_whole(self.states.slot_of(s.request_id), saved)
        return out

    def _fill(self, batch: list[ScheduledRequest], tables: list[torch.Tensor], size: int,
              rope: list[int] | None = None) -> None:
        """Copy the batch into the static buffers, rows past it set to padding."""
        bs, n, pad = self.block_size, len(batch), size - len(batch)
        positions = [s.start_pos for s in batch]
        at = torch.tensor(positions)
        slots = torch.full((len(tables), size), -1, dtype=torch.long)
        for g, table in enumerate(tables):
            slots[g, :n] = table[torch.arange(n), at // bs] * bs + at % bs
        rows = torch.tensor([[s.token_ids[0] for s in batch] + [0] * pad, (rope or positions) + [0] * pad,
                             [p + 1 for p in positions] + [0] * pad])  # [3, size]
        rows = torch.cat([rows, slots]).to(self.device, non_blocking=True)  # [3 + G, size]
        self.input_ids[:size].copy_(rows[0])
        self.positions[:size].copy_(rows[1])
        self.seq_lens[:size].copy_(rows[2])
        self.slot_mapping[:, :size].copy_(rows[3:])
        if self.states is not None:
            state_slots = [self.states.slot_of(s.request_id) for s in batch] + [self.states.padding_slot] * pad
            self.state_slots[:size].copy_(torch.tensor(state_slots).to(self.device, non_blocking=True))
        # Blocks past a row's context are never read: only the used prefix of each table.
        for g, table in enumerate(tables):
            self.block_tables[g, :n, : table.shape[1]].copy_(table.to(torch.int32), non_blocking=True)

    def _forward(self, size: int) -> torch.Tensor:  # [size, hidden]
        metas = [TritonMetadata(
            slot_mapping=self.slot_mapping[g, :size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[g, :size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        ) for g in range(self.slot_mapping.shape[0])]
        meta = GroupedMetadata.of(metas, self.layer_group)
        if self.states is not None:
            states = self.states.for_graph(self.state_slots[:size])
            meta = GroupedMetadata([states if i in self.state_layers else meta.for_layer(i)
                                    for i in range(len(self.layer_group))])
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Largest first, into one memory pool: smaller graphs reuse the largest's blocks."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: compiles this size's kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s",
                    len(self.graphs), self.sizes[0], self.sizes[-1], time.perf_counter() - start)
