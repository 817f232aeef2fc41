"""Draft-model speculative decoding (vLLM's `speculative_config={"model": DIR,
"num_speculative_tokens": k}`): a small model of the same vocabulary guesses the next k
tokens of each request, greedily, and the target model checks them all in one step
(worker/spec_decode.py keeps what plain decoding would have sampled).

The draft has its own model runner and KV cache: a block list per request, taken from a free
list as the request grows and given back when it ends (no prefix caching: a draft is cheap to
recompute). A step first lets the draft catch up, in one batched forward, on each request's
tokens it has not seen (the whole prompt the first time; after that the tokens the target
kept), sampling its first guess there; then each further guess is one batched decode step.
Positions past the request's known tokens hold guesses, which the next catch-up overwrites.
"""

from __future__ import annotations

import dataclasses

from worker.config import EngineConfig
from worker.model_loader import read_config, resolve_model_path
from worker.model_runner import ModelRunner
from worker.models.config import language_config
from worker.scheduler import ScheduledRequest, SchedulerOutput
from worker.spec_decode import Pacing, SpeculativeConfig


class DraftModelProposer:
    """`target_blocks`: the target's KV pool; the draft's holds as many tokens, and each
    running request's guesses. On CUDA the draft's weights and cache come after the target's
    (which take gpu_memory_utilization of the memory): lower it to leave them room."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, max_model_len: int, target_blocks: int,
                 target_vocab_size: int):
        self.config = spec
        path = resolve_model_path(spec.model, config.cache_dir)
        self.block_size = config.block_size
        blocks = target_blocks + config.max_num_seqs * (-(-spec.num_speculative_tokens // config.block_size) + 1)
        draft = dataclasses.replace(config, model=str(path), enable_lora=False, speculative_config=None,
                                    quantization=None,  # the draft as its checkpoint is stored
                                    tensor_parallel_size=1,  # whole, beside rank 0's share of a split target
                                    kv_offloading_size=None,  # its blocks are its own: no prefix cache
                                    num_gpu_blocks_override=blocks,
                                    disable_hybrid_kv_cache_manager=True)  # one table per request
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
        self._free = list(range(self.runner.num_blocks))
        self._tables: dict[str, list[int]] = {}
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
            if num < 1 or not self._reserve(rid, len(token_ids) + num - 1):
                continue
            seen = min(self._seen.get(rid, 0), len(token_ids) - 1)  # at least one token to compute
            catch_up.append(ScheduledRequest(rid, token_ids[seen:], seen, self._tables[rid], True))
            wanted[rid] = num
            self._seen[rid] = len(token_ids)
        if not catch_up:
            return {}
        guesses = self._sample(catch_up)
        for step in range(1, max(wanted.values())):
            batch = [ScheduledRequest(rid, [guesses[rid][-1]], self._seen[rid] + step - 1, self._tables[rid], True)
                     for rid in wanted if len(guesses[rid]) < wanted[rid]]
            for rid, more in self._sample(batch).items():
                guesses[rid] += more
        return guesses

    def _sample(self, batch: list[ScheduledRequest]) -> dict[str, list[int]]:
        out = self.runner.execute(SchedulerOutput(batch))
        tokens = out.logits.argmax(dim=-1).tolist()
        return {rid: [token] for rid, token in zip(out.request_ids, tokens, strict=True)}

    def _reserve(self, rid: str, num_positions: int) -> bool:
        table = self._tables.setdefault(rid, [])
        needed = -(-num_positions // self.block_size) - len(table)
        if needed > len(self._free):
            return False
        for _ in range(max(needed, 0)):
            table.append(self._free.pop())
        return True

    def record(self, request_id: str, num_drafts: int, num_kept: int) -> None:
        self.pacing.record(request_id, num_drafts, num_kept)

    def remove(self, request_id: str) -> None:
        self._free.extend(self._tables.pop(request_id, []))
        self._seen.pop(request_id, None)
        self.pacing.forget(request_id)
