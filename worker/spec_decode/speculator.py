"""Speculative decoding as the engine sees it: one `Speculator`, called at fixed points of
each step, around whichever proposer `speculative_config` names (n-gram lookup, a draft
model, MTP layers, an EAGLE-3 head; worker/spec_decode/speculative.py and draft_model.py).

- `before_step`: a proposer with a cache mirroring the target's blocks follows the step's
  swaps and preemptions;
- `record`: how each request's guesses fared (the stats, and the pacing of its next ones);
- `after_step`: such a proposer takes the rows of the step it reads (hidden states);
- `propose`: guesses for the next step of every decoding request that may speculate,
  cut to what its guided decoding allows.
Without a proposer every call does nothing, but for guided requests' jump-forward: what their
grammar forces next (GuidedDecoding.forced) is guessed, and checked by the model as any guess.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from worker.config import EngineConfig
from worker.spec_decode.draft_model import (
    DraftModelProposer,
    HiddenStateProposer,
    eagle3_proposer,
    holds_eagle3_head,
    mtp_proposer,
)
from worker.spec_decode.speculative import (
    NgramProposer,
    SpecDecodeStats,
    SpeculativeConfig,
    can_speculate,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from worker.core.request import Request
    from worker.core.scheduler import Scheduler, SchedulerOutput
    from worker.guided.structured_output import GuidedDecoding
    from worker.model_executor.model_runner import ModelOutput

Proposer = NgramProposer | DraftModelProposer | HiddenStateProposer
# Jump-forward guesses while at most this many requests run: a larger batch waits for its
# longest reply whatever its guided ones save, and checking their guesses made its steps dearer
# (benchmarks/guided.py, 16 JSON-schema replies on the CPU: 1.11x the free run's time per token
# with them, 0.98x without; one reply writes a small schema's object in a third fewer steps)
JUMP_FORWARD_MAX_BATCH = 8


class Speculator:
    """`proposer` (None: no speculative decoding) for the requests of `scheduler`; seeded
    requests (those with `generators`) may speculate only where their sampling allows it."""

    def __init__(self, proposer: Proposer | None, scheduler: Scheduler, guided: GuidedDecoding,
                 generators: dict[str, torch.Generator], max_model_len: int, jump_forward: bool = True) -> None:
        """`jump_forward`: without a proposer, guided requests guess the text their grammar
        forces (off for a model whose states could not go back from a wrong guess)."""
        self.proposer = proposer
        self.jump_forward = jump_forward
        self.stats = SpecDecodeStats()
        self.scheduler = scheduler
        self.guided = guided
        self.generators = generators
        self.max_model_len = max_model_len
        self._tables: dict[str, list[int]] = {}  # the step's group-0 tables, as it was scheduled

    def before_step(self, sched: SchedulerOutput) -> None:
        if isinstance(self.proposer, HiddenStateProposer):  # (its cache mirrors the target's blocks)
            # (the block manager's own lists: the step's update may release entries behind a window)
            self._tables = {s.request_id: s.tables()[0] for s in sched.scheduled}
            self.proposer.swap_blocks(sched.swaps)
            for request_id in sched.preempted:  # (it computes its rows again, as a new request would)
                self.proposer.remove(request_id)

    def record(self, drafts: dict[str, list[int]], sampled: dict[str, list[int]]) -> None:
        """How the guesses fared: counted, and pacing the next (`sampled`: each request's
        kept tokens, its guesses kept and one more)."""
        if self.proposer is None:
            return
        for rid, guesses in drafts.items():
            if guesses and rid in sampled:
                self.stats.add(len(guesses), len(sampled[rid]) - 1)
                self.proposer.record(rid, len(guesses), len(sampled[rid]) - 1)

    def after_step(self, sched: SchedulerOutput, out: ModelOutput, sampled: dict[str, list[int]]) -> None:
        if isinstance(self.proposer, HiddenStateProposer):
            self.proposer.take_rows(self._kept_rows(sched, out, sampled), guessing=not self.guessing_off())

    def remove(self, request_id: str) -> None:
        if self.proposer is not None:
            self.proposer.remove(request_id)

    def _kept_rows(self, sched: SchedulerOutput, out: ModelOutput, sampled: dict[str, list[int]]
                   ) -> list[tuple[str, int, list[int], torch.Tensor, int, list[int]]]:
        """What a draft layer reads of a step (HiddenStateProposer.take_rows): each request's rows
        whose inputs it keeps (its known tokens and the guesses kept), with their tokens and
        the one after, the states it reads (final hidden states, or an EAGLE-3 head's aux
        ones), and the request's block table. Requests that never guess are in too: others
        may share their blocks."""
        assert isinstance(self.proposer, HiddenStateProposer)
        states = out.aux if self.proposer.reads_aux else out.hidden
        assert states is not None
        rows = []
        for s in sched.scheduled:
            request = self.scheduler.requests.get(s.request_id)
            if request is None or s.pool:
                continue  # (ended)
            kept = len(s.token_ids) - s.num_drafts + max(len(sampled.get(s.request_id, ())) - 1, 0)
            tokens = request.token_slice(s.start_pos, min(s.start_pos + 1 + kept, request.num_tokens))
            start = out.rows[s.request_id][0]
            rows.append((s.request_id, s.start_pos, tokens, states[start : start + len(tokens) - 1],
                         request.num_tokens, self._tables[s.request_id]))
        return rows

    def guessing_off(self) -> bool:
        """Whether disable_by_batch_size turns guessing off now: as many requests run or more."""
        assert self.proposer is not None
        limit = self.proposer.config.disable_by_batch_size
        return limit is not None and len(self.scheduler.running) >= limit

    def propose(self) -> None:
        """Guesses for the next step of every decoding request that may speculate."""
        if self.proposer is None:
            if self.jump_forward and self.guided.states and len(self.scheduler.running) <= JUMP_FORWARD_MAX_BATCH:
                for request, room in self._candidates(lambda r: r.request_id in self.guided.states):
                    request.spec_token_ids = self.guided.forced(request.request_id, request.output_token_ids, room)
            return
        if self.guessing_off():
            return
        candidates = self._candidates(lambda r: True)
        ngrams = isinstance(self.proposer, NgramProposer)  # (it alone reads predicted outputs)
        guesses = self.proposer.propose_all([(r.request_id, r.lookup_token_ids if ngrams else r.all_token_ids, room)
                                             for r, room in candidates])
        for request, _ in candidates:
            request.spec_token_ids = self.guided.fitting(request.request_id, request.output_token_ids,
                                                         guesses.get(request.request_id, []))


    def _candidates(self, wanted: Callable[[Request], bool]) -> list[tuple[Request, int]]:
        """The running requests that decode, may speculate and are `wanted`, each with how many
        guesses it has room for (none past max_tokens or max_model_len: the step's last token
        needs room)."""
        candidates = []
        for request in self.scheduler.running:
            if request.num_computed_tokens != request.num_tokens - 1 and (
                    request.num_computed_tokens < request.num_prompt_tokens):
                continue  # still prefilling (a model with states recomputes the guesses it kept: it guesses on)
            if not wanted(request) or not can_speculate(request.sampling_params, request.request_id in self.generators):
                continue
            room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
            candidates.append((request, room))
        return candidates


def make_proposer(config: EngineConfig, runner: Any, model_path: Path, max_model_len: int) -> Proposer | None:
    """The proposer `config.speculative_config` names, beside the target's `runner` (None
    without one): an MTP layer's or an EAGLE-3 head's reads the target's hidden states and
    mirrors its blocks; a draft model's has a runner and a pool of its own."""
    model_config = runner.model_config
    if not config.speculative_config:
        return None
    spec = SpeculativeConfig.from_dict(config.speculative_config)
    if spec.method == "draft_model" and holds_eagle3_head(spec, config):
        spec = replace(spec, method="eagle3")
    if spec.method == "ngram":
        return NgramProposer(spec)
    # the draft holds as many tokens as the target's pool would with one KV group: a hybrid
    # target's blocks each hold a few layers, and sizing by their count would make the
    # draft's pool (every layer a block) as many times larger (it guesses less once full)
    target_blocks = runner.num_blocks * runner.num_slots // model_config.num_hidden_layers
    if spec.method == "mtp":  # (its cache mirrors the target's blocks)
        return mtp_proposer(spec, config, model_path, model_config.hf_config, max_model_len,
                            runner.num_blocks, runner.model, runner.num_host_blocks,
                            given=runner.image_embeds)
    if spec.method == "eagle3":
        return eagle3_proposer(spec, config, max_model_len, runner.num_blocks, runner.model,
                               runner.num_host_blocks, given=runner.image_embeds)
    return DraftModelProposer(spec, config, max_model_len, target_blocks, model_config.vocab_size)
