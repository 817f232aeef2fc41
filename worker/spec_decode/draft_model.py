"""Draft-model speculative decoding (vLLM's `speculative_config={"model": DIR,
"num_speculative_tokens": k}`): a small model of the same vocabulary guesses the next k
tokens of each request, greedily, and the target model checks them all in one step
(worker/spec_decode/speculative.py keeps what plain decoding would have sampled). And the same with a
draft layer that reads the target's hidden states (HiddenStateProposer): the target's own
multi-token-prediction layer (`{"method": "mtp"}`) or an EAGLE-3 head (`{"method": "eagle3"}`).

The draft has its own model runner and KV cache: a block list per request, taken from a free
list as the request grows and given back when it ends (no prefix caching: a draft is cheap to
recompute). A step first lets the draft catch up, in one batched forward, on each request's
tokens it has not seen (the whole prompt the first time; after that the tokens the target
kept), sampling its first guess there; then each further guess is one batched decode step.
Positions past the request's known tokens hold guesses, which the next catch-up overwrites.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch

from worker.config import EngineConfig
from worker.core.block_manager import KVSwaps
from worker.core.scheduler import ScheduledRequest, SchedulerOutput
from worker.model_executor.image_encoders import ImageEmbeddings, ShiftedEmbeddings
from worker.model_executor.model_loader import read_config, resolve_model_path
from worker.model_executor.model_runner import ModelRunner
from worker.model_executor.models.config import architecture_of, language_config
from worker.model_executor.models.eagle3 import (
    EAGLE3_ARCHITECTURES,
    Eagle3Head,
    aux_layers,
    eagle3_hf_config,
    is_eagle3,
    read_head_config,
)
from worker.model_executor.models.llama import HiddenStateDraft, LlamaForCausalLM
from worker.model_executor.models.mtp import MultiTokenPredictor, check_has_mtp, mtp_hf_config
from worker.spec_decode.speculative import Pacing, SpeculativeConfig


class DraftBlocks:
    """A draft's KV blocks: a table per request, taken from a free list as the request grows
    and given back when it ends (no prefix caching: a draft is cheap to recompute)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free = list(range(num_blocks))
        self.tables: dict[str, list[int]] = {}

    def reserve(self, rid: str, num_positions: int) -> bool:
        """Whether the request's table now covers `num_positions` positions (False: too few
        blocks are free, and it is as it was)."""
        table = self.tables.setdefault(rid, [])
        needed = -(-num_positions // self.block_size) - len(table)
        if needed > len(self.free):
            return False
        for _ in range(max(needed, 0)):
            table.append(self.free.pop())
        return True

    def remove(self, rid: str) -> None:
        self.free.extend(self.tables.pop(rid, []))


def draft_config(config: EngineConfig, spec: SpeculativeConfig, target_blocks: int, **changes: Any) -> EngineConfig:
    """A draft runner's engine config: rank 0's alone, beside a split target; no adapters,
    offloading or hybrid tables; a pool of `target_blocks` (as many tokens as the target's)
    and each running request's guesses."""
    blocks = target_blocks + config.max_num_seqs * (-(-spec.num_speculative_tokens // config.block_size) + 1)
    changes = {"num_gpu_blocks_override": blocks, **changes}
    return dataclasses.replace(config, enable_lora=False, speculative_config=None,
                               tensor_parallel_size=1,  # whole, beside rank 0's share of a split target
                               kv_offloading_size=None,  # no host tier of its own
                               disable_hybrid_kv_cache_manager=True, **changes)  # one table per request


class DraftModelProposer:
    """`target_blocks`: the target's KV pool; the draft's holds as many tokens, and each
    running request's guesses. On CUDA the draft's weights and cache come after the target's
    (which take gpu_memory_utilization of the memory): lower it to leave them room."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, max_model_len: int, target_blocks: int,
                 target_vocab_size: int):
        self.config = spec
        path = resolve_model_path(spec.model, config.cache_dir)
        draft = draft_config(config, spec, target_blocks, model=str(path),
                             quantization=None)  # the draft as its checkpoint is stored
        self.runner = ModelRunner(draft, path, language_config(read_config(path)), max_model_len)
        vocab_size = self.runner.model_config.vocab_size
        if vocab_size != target_vocab_size:
            raise ValueError(f"the draft model's vocabulary ({vocab_size} tokens) is not the target model's "
                             f"({target_vocab_size}): a draft must share the target's tokenizer")
        if not self.runner.model_config.has_lm_head:
            raise ValueError(f"the draft model ({self.runner.model_config.architecture}) has no LM head")
        if self.runner.states is not None:  # its guesses, rejected, would stay in its state
            raise ValueError(f"the draft model ({self.runner.model_config.architecture}) has linear-attention "
                             "layers, which cannot take back rejected guesses; draft with an attention-only model")
        self.blocks = DraftBlocks(self.runner.num_blocks, config.block_size)
        self._seen: dict[str, int] = {}  # tokens of the request whose KV the draft holds
        self.pacing = Pacing(spec.num_speculative_tokens)

    def propose_all(self, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """Up to num_speculative_tokens greedy guesses for each (request id, token ids, most
        guesses), fewer as a request's recent guesses failed or its blocks ran out."""
        wanted: dict[str, int] = {}
        catch_up: list[ScheduledRequest] = []
        for rid, token_ids, room in requests:
            num = min(room, self.pacing.allowed(rid))
            # the last guess is sampled, never fed back: its position needs no slot
            if num < 1 or not self.blocks.reserve(rid, len(token_ids) + num - 1):
                continue
            seen = min(self._seen.get(rid, 0), len(token_ids) - 1)  # at least one token to compute
            catch_up.append(ScheduledRequest(rid, token_ids[seen:], seen, self.blocks.tables[rid], True))
            wanted[rid] = num
            self._seen[rid] = len(token_ids)
        if not catch_up:
            return {}
        guesses = self._sample(catch_up)
        for step in range(1, max(wanted.values())):
            batch = [ScheduledRequest(rid, [guesses[rid][-1]], self._seen[rid] + step - 1, self.blocks.tables[rid], True)
                     for rid in wanted if len(guesses[rid]) < wanted[rid]]
            for rid, more in self._sample(batch).items():
                guesses[rid] += more
        return guesses

    def _sample(self, batch: list[ScheduledRequest]) -> dict[str, list[int]]:
        out = self.runner.execute(SchedulerOutput(batch))
        tokens = out.logits.argmax(dim=-1).tolist()
        return {rid: [token] for rid, token in zip(out.request_ids, tokens, strict=True)}

    def record(self, request_id: str, num_drafts: int, num_kept: int) -> None:
        self.pacing.record(request_id, num_drafts, num_kept)

    def remove(self, request_id: str) -> None:
        self.blocks.remove(request_id)
        self._seen.pop(request_id, None)
        self.pacing.forget(request_id)


class HiddenStateProposer:
    """Guesses from a draft layer that reads the target's hidden states: the target's own
    multi-token-prediction layer (worker.model_executor.models.mtp: its final hidden states, and its
    embedding and LM head) or an EAGLE-3 head (worker.model_executor.models.eagle3: the residual stream
    before three of its layers, `reads_aux`), run in a runner of its own (`mtp_proposer`,
    `eagle3_proposer` make them). After each target step the layer computes the rows the
    target kept (`take_rows`), in one batched forward that also makes each request's first
    guess; each further guess is one batched step feeding the layer its own output.

    The layer's KV cache mirrors the target's blocks: its block b holds the layer's entries
    for the positions the target's block b holds, so what the target shares (prefix-cache
    hits, an n > 1 request's prompt) the layer has too. Every generating request's rows are
    computed, for the blocks others may share. A shared block's last entry read the token
    after it of the request that computed it: a request whose first rows follow a shared
    prefix computes that entry again with its own token, in a private copy of the block (the
    target's final hidden state at each block's last position is kept for this). Guesses
    past the known tokens go to scratch blocks of the request's own (the block they start in
    copied there first), never to blocks the target holds. With KV offloading the layer's
    blocks (and hidden states kept) go to host slots and back with the target's."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, layer: tuple[Path, Any, type[HiddenStateDraft]],
                 max_model_len: int, target_blocks: int, target: LlamaForCausalLM, num_host_blocks: int = 0,
                 reads_aux: bool = False, given: ImageEmbeddings | None = None):
        """`layer`: the draft layer's checkpoint directory, config and model class (one with
        `share_with(target)`); `target`: the target's (rank 0's) model; `target_blocks`,
        `num_host_blocks`: the target's pool and host slots; `given`: the target's given rows
        (images', prompt embeddings), which the layer's rows of those tokens read too."""
        self.config = spec
        self.block_size = config.block_size
        self.reads_aux = reads_aux
        # a request's guesses past its known tokens span this many blocks at most
        per_request = -(-(spec.num_speculative_tokens - 1) // config.block_size) + 1
        # blocks: the target's twins, a private one and the scratch ones per running request
        layer_config = draft_config(config, spec, target_blocks, enforce_eager=True,
                                    num_gpu_blocks_override=target_blocks + config.max_num_seqs * (1 + per_request))
        path, hf_config, model_class = layer
        self.runner = ModelRunner(layer_config, path, hf_config, max_model_len, model_class=model_class)
        draft = self.runner.model
        assert isinstance(draft, HiddenStateDraft)
        draft.share_with(target)
        if given is not None:
            self.runner.image_embeds = ShiftedEmbeddings(given)
        num_private = config.max_num_seqs
        self.scratch = DraftBlocks(config.max_num_seqs * per_request, config.block_size)
        self.scratch.free = [target_blocks + num_private + b for b in self.scratch.free]
        self._private_free = [target_blocks + b for b in range(num_private)]
        self._private: dict[str, tuple[int, int]] = {}  # request id -> (block index, its private block)
        self._fed: set[str] = set()  # requests the layer has computed rows of
        width = 3 * target.config.hidden_size if reads_aux else target.config.hidden_size
        self.last_hidden = torch.zeros(target_blocks, width, dtype=self.runner.dtype,
                                       device=self.runner.device)  # the target's, at each block's last position
        self.host_hidden = torch.zeros(num_host_blocks, width, dtype=self.runner.dtype)
        if num_host_blocks:  # host slots as the target's, each the layer's share of a block
            pool, pinned = self.runner.kv_pool, self.runner.device.type == "cuda"
            self.runner.host_pool = torch.empty((*pool.shape[:2], num_host_blocks, *pool.shape[3:]),
                                                dtype=pool.dtype, pin_memory=pinned)
            self.host_hidden = self.host_hidden.pin_memory() if pinned else self.host_hidden
        self.pacing = Pacing(spec.num_speculative_tokens)
        # request id -> (its tokens when the guess was made, its first guess, the layer's output
        # there, its table then)
        self._first: dict[str, tuple[int, int, torch.Tensor, list[int]]] = {}

    def reload_weights(self, source: Path | Mapping[str, torch.Tensor], target: LlamaForCausalLM) -> None:
        """An MTP layer's weights, read from the target's new checkpoint (Engine.reload_weights);
        an EAGLE-3 head's are its own checkpoint's, and stay."""
        if isinstance(self.runner.model, MultiTokenPredictor):
            self.runner.reload_weights(source, adjust=lambda fresh: cast(HiddenStateDraft, fresh).share_with(target))

    def take_rows(self, rows: list[tuple[str, int, list[int], torch.Tensor, int, list[int]]],
                  guessing: bool = True) -> None:
        """A target step's rows that each request keeps: (request id, the first one's
        position, the tokens from there to the one after the last row, the target's final
        hidden states [rows, hidden], the request's tokens now, its block table). The layer
        computes them into its cache; where they reach the request's last token, the guess
        after it is made, unless none is wanted: not `guessing` (disable_by_batch_size), or
        the request's guesses wait this step (its logits cost as much as the layer at small
        sizes)."""
        batch: list[ScheduledRequest] = []
        inputs: dict[str, torch.Tensor] = {}
        tables: dict[str, list[int]] = {}
        for rid, start, tokens, hidden, num_tokens, table in rows:
            self._first.pop(rid, None)
            if len(tokens) < 2:
                continue
            self._keep_block_ends(start, hidden, table)
            first, ids = start, tokens[1:]
            if start and rid not in self._fed and self._private_free:  # after a shared prefix
                first, ids = start - 1, tokens
                hidden = torch.cat([self.last_hidden[table[first // self.block_size]][None], hidden])
                self._private[rid] = (first // self.block_size, self._private_free.pop())
                self._copy_block(table[first // self.block_size], self._private[rid][1])
            self._fed.add(rid)
            tables[rid] = self._own_table(rid, table)
            ends = first + len(ids) == num_tokens - 1
            wanted = ends and guessing and self.pacing.guesses_next(rid)
            batch.append(ScheduledRequest(rid, ids, first, tables[rid], wanted))
            inputs[rid] = hidden
        if not batch:
            return
        sizes = {s.request_id: s.start_pos + len(s.token_ids) + 1 for s in batch}
        for rid, (guess, state) in self._run(batch, inputs).items():
            self._first[rid] = (sizes[rid], guess, state, tables[rid])

    def _keep_block_ends(self, start: int, hidden: torch.Tensor, table: list[int]) -> None:
        """Keep the target's hidden states at the last positions of blocks among rows from `start`."""
        size = self.block_size
        rows = list(range(-(start + 1) % size, len(hidden), size))
        if rows:
            blocks = torch.tensor([table[(start + row) // size] for row in rows], device=self.last_hidden.device)
            self.last_hidden.index_copy_(0, blocks, hidden[rows].to(self.last_hidden.dtype))

    def _own_table(self, rid: str, table: list[int]) -> list[int]:
        """The request's table with its private block, if it has one."""
        if rid not in self._private:
            return table
        index, block = self._private[rid]
        return [*table[:index], block, *table[index + 1 :]]

    def swap_blocks(self, swaps: KVSwaps) -> None:
        """The target's KV offloading copies, made of the layer's blocks too."""
        if not (swaps.out or swaps.back):
            return
        self.runner.swap_blocks(KVSwaps(swaps.out, swaps.back))
        if swaps.out:
            block_in = {slot: block for block, slot in swaps.out}  # a slot given twice: its last
            self.host_hidden[list(block_in)] = self.last_hidden[list(block_in.values())].to("cpu")
        if swaps.back:
            slot_for = {block: slot for slot, block in swaps.back}
            blocks = torch.tensor(list(slot_for), device=self.last_hidden.device)
            self.last_hidden[blocks] = self.host_hidden[list(slot_for.values())].to(self.last_hidden.device)

    def _copy_block(self, source: int, dest: int) -> None:
        pool = self.runner.kv_pool.view(torch.uint8)  # [slots, pools, blocks, ...] (fp8 has no index_put)
        pool[:, :, dest] = pool[:, :, source]

    def propose_all(self, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """Up to num_speculative_tokens greedy guesses for each (request id, token ids, most
        guesses), fewer as a request's recent guesses failed or scratch blocks ran out."""
        guesses: dict[str, list[int]] = {}
        states: dict[str, torch.Tensor] = {}
        wanted: dict[str, tuple[int, int, list[int]]] = {}  # request id -> (guesses, its tokens, table)
        for rid, token_ids, room in requests:
            first = self._first.get(rid)
            num = min(room, self.pacing.allowed(rid))
            if first is None or first[0] != len(token_ids) or num < 1:
                continue
            guesses[rid], states[rid] = [first[1]], first[2]
            table = self._chain_table(rid, len(token_ids), num, first[3]) if num > 1 else []
            wanted[rid] = (num if table else 1, len(token_ids), table)
        for step in range(1, max((num for num, _, _ in wanted.values()), default=0)):
            # guess k + 1 is the layer's at position len - 2 + k
            batch = [ScheduledRequest(rid, [guesses[rid][-1]], size - 2 + step, table, True)
                     for rid, (num, size, table) in wanted.items() if len(guesses[rid]) < num]
            for rid, (guess, state) in self._run(batch, {s.request_id: states[s.request_id][None] for s in batch}).items():
                guesses[rid].append(guess)
                states[rid] = state
        return guesses

    def _chain_table(self, rid: str, num_tokens: int, num: int, table: list[int]) -> list[int]:
        """The block table further guesses run with: the target's blocks before the one
        position num_tokens - 1 falls in, then the request's scratch blocks, the first a copy
        of that block (the layer's entries before the position); [] where none are free."""
        self.scratch.remove(rid)
        first = (num_tokens - 1) // self.block_size
        last = num_tokens + num - 3  # the last guess's position
        if not self.scratch.reserve(rid, (last // self.block_size + 1 - first) * self.block_size):
            return []
        scratch = self.scratch.tables[rid]
        if (num_tokens - 1) % self.block_size and first < len(table):
            self._copy_block(table[first], scratch[0])
        return table[:first] + scratch

    def _run(self, batch: list[ScheduledRequest], inputs: dict[str, torch.Tensor]) -> dict[str, tuple[int, torch.Tensor]]:
        """The layer over `batch`: each sampling request's greedy guess, and the layer's output
        at its last row (what the next guess reads)."""
        out = self.runner.execute(SchedulerOutput(batch), hidden=inputs)
        assert out.hidden is not None
        tokens = out.logits.argmax(dim=-1).tolist()
        return {rid: (token, out.hidden[out.rows[rid][1] - 1]) for rid, token in zip(out.request_ids, tokens, strict=True)}

    def record(self, request_id: str, num_drafts: int, num_kept: int) -> None:
        self.pacing.record(request_id, num_drafts, num_kept)

    def remove(self, request_id: str) -> None:
        self.scratch.remove(request_id)
        if request_id in self._private:
            self._private_free.append(self._private.pop(request_id)[1])
        self._fed.discard(request_id)
        self._first.pop(request_id, None)
        self.pacing.forget(request_id)


def mtp_proposer(spec: SpeculativeConfig, config: EngineConfig, model_path: Path, hf_config: Any,
                 max_model_len: int, target_blocks: int, target: LlamaForCausalLM,
                 num_host_blocks: int = 0, given: ImageEmbeddings | None = None) -> HiddenStateProposer:
    """Guesses from the MTP layer in the target's checkpoint (`model_path`, `hf_config`);
    `given`: the target's given rows (HiddenStateProposer)."""
    check_has_mtp(hf_config)
    return HiddenStateProposer(spec, config, (model_path, mtp_hf_config(hf_config), MultiTokenPredictor),
                               max_model_len, target_blocks, target, num_host_blocks, given=given)


def holds_eagle3_head(spec: SpeculativeConfig, config: EngineConfig) -> bool:
    """The draft `model` is an EAGLE-3 head (as vLLM does, a head given without its method
    guesses as one)."""
    return spec.model is not None and is_eagle3(read_head_config(resolve_model_path(spec.model, config.cache_dir)))


def eagle3_proposer(spec: SpeculativeConfig, config: EngineConfig, max_model_len: int, target_blocks: int,
                    target: LlamaForCausalLM, num_host_blocks: int = 0,
                    given: ImageEmbeddings | None = None) -> HiddenStateProposer:
    """Guesses from the EAGLE-3 head in `spec.model`; the target keeps the residual stream
    before the layers the head reads (its steps then run eagerly: the CUDA graphs keep no
    such states)."""
    path = resolve_model_path(spec.model, config.cache_dir)
    head_config = read_head_config(path)
    if not is_eagle3(head_config):
        raise ValueError(f"speculative method 'eagle3' needs an EAGLE-3 head ({', '.join(EAGLE3_ARCHITECTURES)}); "
                         f"{path} holds {architecture_of(head_config, 'none')}")
    if head_config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the EAGLE-3 head's vocabulary ({head_config.vocab_size} tokens) is not the target "
                         f"model's ({target.config.vocab_size})")
    target.aux_layers = aux_layers(head_config, target.config.num_hidden_layers)
    return HiddenStateProposer(spec, config, (path, eagle3_hf_config(head_config, path), Eagle3Head),
                               max_model_len, target_blocks, target, num_host_blocks, reads_aux=True, given=given)
