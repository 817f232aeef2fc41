"""Continuous-batching scheduler. Plain Python: no torch, no Redis, no asyncio.

There is no separate prefill phase: every request has `num_computed_tokens` that catches up
with `num_tokens` under a per-step token budget shared by decodes and prefill chunks. Running
requests are served first; waiting requests are admitted while budget, `max_num_seqs` and KV
blocks allow. When blocks run out, the lowest-priority running request is preempted by
recompute: its blocks are freed and it returns to the waiting queue with its output so far.

A caller may also cap a step's prefill tokens (`schedule(prefill_budget)`: the engine's
step-time-aware chunking sizes it so the step stays under a target time): decodes are not
capped, prompt chunks share the cap. A chunk that must hold an image whole may exceed it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from worker.config import SchedulerConfig
from worker.core.block_manager import BlockManager, KVSwaps
from worker.core.request import Request, RequestStatus

NO_TOKENS: tuple[int, ...] = ()  # what a request the step's sampling left out appends


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # position of token_ids[0]; the cache holds positions [0, start_pos)
    # group 0's (the full layers' where the model mixes kinds); the scheduler's are the block
    # manager's own lists, not copies (RELEASED entries in them: read them through tables())
    block_table: list[int]
    sample: bool  # the step reaches the end of the known tokens, so a token is sampled
    prompt_logprobs: bool = False  # the request wants logprobs for the prompt tokens computed here
    lora_id: int = 0  # the adapter its rows run with; 0: none
    num_drafts: int = 0  # token_ids ends with this many guessed tokens (speculative decoding)
    pool: bool = False  # an embedding request's last chunk: its last row is pooled, not sampled
    group_tables: tuple[list[int], ...] = ()  # the other KV groups' tables (windowed layers)
    # ranges [start, end) of positions this step computes (some of) whose tokens each see
    # the whole range, later ones too (Request.whole_spans)
    both_ways: tuple[tuple[int, int], ...] = ()
    # linear attention's states (BlockManager.states): the saved one the request's first step
    # after a prefix-cache hit starts from, and the (tokens before, slot) this step saves
    state_restore: int | None = None
    state_saves: tuple[tuple[int, int], ...] = ()

    def tables(self) -> list[list[int]]:
        """A block table per KV group, a released entry read as block 0 (attention masks its
        positions)."""
        return [[max(b, 0) for b in table] for table in (self.block_table, *self.group_tables)]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_decode_tokens: int = 0  # the tokens of rows that decode (one known token, and its guesses)
    preempted: list[str] = field(default_factory=list)
    # KV offloading's copies, made before the step runs (even one left with no request to run)
    swaps: KVSwaps = field(default_factory=KVSwaps)
    # the requests that ended since the scheduler's previous output (their rows in the runner's
    # persistent batch are freed, as the preempted ones'); None from a caller that keeps no
    # such account (a draft model's steps, tests): the runner then reads each step's tables whole
    finished_ids: list[str] | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_prefill_tokens(self) -> int:
        """The tokens of prompt chunks (a preempted request's recompute too)."""
        return self.num_batched_tokens - self.num_decode_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Requests finished by the last update, kept until the engine has reported them.
        self.finished: dict[str, Request] = {}
        # Sibling completions (n > 1) that wait for their first sibling's prompt, then share it.
        self.forks: dict[str, list[Request]] = {}
        self.num_preemptions = 0
        self._ended: list[str] = []  # requests ended since the last schedule (SchedulerOutput.finished_ids)
        self._prefill_left = 0  # the step's prefill tokens still allowed (schedule's prefill_budget)

    # -- queue management -------------------------------------------------------------------

    def add_request(self, request: Request, forks: Iterable[Request] = ()) -> None:
        """Queue a request. `forks` (the other completions of an n > 1 request) are held back
        until `request` has computed the prompt, then take its prompt blocks by reference."""
        self.requests[request.request_id] = request
        self.waiting.append(request)
        forks = list(forks)
        if forks:
            self.forks[request.request_id] = forks
            for fork in forks:
                self.requests[fork.request_id] = fork

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish requests at once and free their blocks; unknown ids are ignored."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        finished = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            self._ended.append(request_id)
            self._release_forks(request)  # they compute the prompt themselves now
            request.status = status
            self.block_manager.free_request(request_id)
            self.finished[request_id] = request
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- scheduling ---------------------------------------------------------------------------

    def num_decode_tokens(self) -> int:
        """The tokens the running requests that decode will carry next step (one each, and
        their guesses): what a prefill budget is sized after."""
        return sum(1 + len(r.spec_token_ids) for r in self.running if r.num_tokens - r.num_computed_tokens <= 1)

    def num_prompt_tokens_pending(self) -> int:
        """The prompt tokens the waiting and running requests have still to compute: a backlog
        (step-time-aware chunking gives way to throughput past a few steps' worth)."""
        pending = 0
        for requests in (self.running, self.waiting):
            for r in requests:
                left = r.num_prompt_tokens - r.num_computed_tokens
                if left > 0:
                    pending += left
        return pending

    def schedule(self, prefill_budget: int | None = None) -> SchedulerOutput:
        """The next step. `prefill_budget`: the most prompt tokens it may carry, beside its
        decodes (None: as the token budget allows)."""
        out = SchedulerOutput()
        self.block_manager.settle_state_saves(())  # (saves of a step that never ran are void)
        budget = self.config.max_num_batched_tokens
        self._prefill_left = budget if prefill_budget is None else max(prefill_budget, 0)
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.swaps = self.block_manager.take_swaps()
        out.finished_ids, self._ended = self._ended, []
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: dict[str, int] = {}  # request id -> tokens scheduled, for refunds
        prefills: set[str] = set()  # those of them that are prompt chunks
        allocate = self.block_manager.allocate_slots
        running = RequestStatus.RUNNING  # (a global's lookup a request, else)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_known = request.num_tokens - request.num_computed_tokens
            num_new = min(num_known + len(request.spec_token_ids), budget)
            prefill = num_known > 1
            if prefill:
                num_new = self._cap_prefill(request, request.num_computed_tokens, num_new)
            elif request.whole_spans:
                num_new = _keep_spans_whole(request, request.num_computed_tokens, num_new)
            if num_new == 0:  # the next image does not fit this step's budget: it waits for one that does
                i += 1
                continue
            while not allocate(request, num_new):
                if request.spec_token_ids:  # guesses are not worth preempting anyone for
                    num_new -= min(len(request.spec_token_ids), max(num_new - 1, 0))
                    request.spec_token_ids = []
                    continue
                victim = self._pick_victim()
                self._preempt(victim, out)
                if victim.request_id in scheduled:
                    refund = scheduled.pop(victim.request_id)
                    budget += refund
                    if victim.request_id in prefills:
                        self._prefill_left += refund
                    else:
                        out.num_decode_tokens -= refund
                    out.scheduled = [s for s in out.scheduled if s.request_id != victim.request_id]
                if victim is request:
                    break
            if request.status is not running:
                continue  # it preempted itself; the list shifted under i
            self._emit(out, request, num_new)
            scheduled[request.request_id] = num_new
            budget -= num_new
            if prefill:
                prefills.add(request.request_id)
                self._prefill_left -= num_new
            else:
                out.num_decode_tokens += num_new
            # (a victim before it, when priorities pick one, shifted the list)
            i = i + 1 if i < len(self.running) and self.running[i] is request else self.running.index(request) + 1
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        self._sort_waiting()
        adapters = {r.lora_id for r in self.running if r.lora_id}
        i = 0
        while (i < len(self.waiting) and budget > 0 and self._prefill_left > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[i]
            if self._lacks_adapter_slot(request, adapters):
                i += 1  # later requests may run with an adapter that is running already
                continue
            # A forked request already holds its shared prompt blocks; others look up the cache.
            forked = request.num_computed_tokens > 0
            if forked and self.block_manager.states is not None and self.block_manager.saved_state(
                    request, request.num_computed_tokens) is None:  # its parent's state there was evicted
                self.block_manager.free_request(request.request_id)
                request.num_computed_tokens = 0
                forked = False
            computed = None if forked else self.block_manager.get_computed_blocks(request)
            num_computed = request.num_computed_tokens + (len(computed[0]) * self.block_manager.block_size
                                                          if computed else 0)
            num_new = self._cap_prefill(request, num_computed, min(request.num_tokens - num_computed, budget))
            if num_new == 0 or not self.block_manager.allocate_slots(request, num_new, computed):
                break
            self.waiting.pop(i)
            if request.lora_id:
                adapters.add(request.lora_id)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_computed
            self.running.append(request)
            self._emit(out, request, num_new, self.block_manager.saved_state(request, num_computed))
            budget -= num_new
            self._prefill_left -= num_new
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget

    def _cap_prefill(self, request: Request, start: int, num_new: int) -> int:
        """A prompt chunk of at most `num_new` tokens from `start` under the step's prefill
        budget, ending outside the request's whole spans. Where the budget ends inside a span
        the chunk cannot stop before, the chunk runs to that span's end (past the budget: the
        budget may stay below the span's length, and the image would wait forever)."""
        cap = max(self._prefill_left, 0)
        capped = _keep_spans_whole(request, start, min(num_new, cap))
        if capped == 0 and 0 < cap < num_new and request.whole_spans:  # (the cap bit, not the budget)
            through = [hi for lo, hi in request.whole_spans if lo < start + cap < hi]
            if through:
                return _keep_spans_whole(request, start, min(num_new, max(through) - start))
        return capped

    def _lacks_adapter_slot(self, request: Request, adapters: set[int]) -> bool:
        """Its adapter is not running and every slot is: it waits, without holding others up."""
        return bool(request.lora_id) and request.lora_id not in adapters and len(adapters) >= self.config.max_loras

    def _emit(self, out: SchedulerOutput, request: Request, num_new: int, state_restore: int | None = None) -> None:
        start = request.num_computed_tokens
        num_tokens = request.num_tokens
        end = min(start + num_new, num_tokens)
        drafts = request.spec_token_ids[: num_new - (end - start)] if request.spec_token_ids else None  # (budget's room)
        num_prompt = request.num_prompt_tokens
        # (a decode's one output token read here, the common entry: not through token_slice)
        tokens = [request.output_token_ids[start - num_prompt]] if end - start == 1 and start >= num_prompt else \
            request.token_slice(start, end)
        bm = self.block_manager
        tables = bm.req_blocks.get(request.request_id) or bm.block_tables(request.request_id)
        # (positional, the rest as the defaults say: a decode's entry is made for every request every step)
        sched = ScheduledRequest(request.request_id, tokens + drafts if drafts else tokens, start, tables[0],
                                 end == num_tokens)
        if drafts:
            sched.num_drafts = len(drafts)
        if request.lora_id:
            sched.lora_id = request.lora_id
        if len(tables) > 1:
            sched.group_tables = tuple(tables[1:])
        if start < num_prompt:  # (only a prompt's chunk has some)
            sched.prompt_logprobs = request.sampling_params.prompt_logprobs is not None
        if request.pooling_params is not None:
            sched.pool = end == num_tokens
        if request.whole_spans:
            sched.both_ways = tuple((lo, hi) for lo, hi in request.whole_spans if lo < end and hi > start)
        if bm.states is not None:
            sched.state_restore = state_restore
            sched.state_saves = bm.reserve_state_saves(request, start, end, also=self._fork_point(request))
        out.scheduled.append(sched)

    def _sort_waiting(self) -> None:
        policy = self.config.policy
        self.waiting.sort(key=lambda r: r.sort_key(policy))

    def _pick_victim(self) -> Request:
        """The running request that yields first: the latest arrival, or for `priority` the
        largest priority value (ties: the latest arrival)."""
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.block_manager.free_request(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, request)
        out.preempted.append(request.request_id)

    # -- after the model ran -----------------------------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens (several when guesses were right:
        the guesses kept, then one more), and finish requests that hit EOS, a stop token id,
        max_tokens or max_model_len. Returns the requests finished here."""
        finished: list[Request] = []
        bm = self.block_manager
        bm.settle_state_saves(slot for s in out.scheduled for _, slot in s.state_saves)
        windowed = bm.windowed  # (else no block leaves a window: not a call a request to find none)
        for sched in out.scheduled:
            request = self.requests.get(sched.request_id)
            if request is None:
                continue  # aborted while the step ran
            token_ids = sampled.get(sched.request_id, NO_TOKENS)
            if sched.num_drafts:
                num_rejected = sched.num_drafts - max(len(token_ids) - 1, 0)
                # the KV of rejected guesses stays past num_computed_tokens, to be overwritten; a
                # model with states went back to the one before any guess (SchedulerConfig.recurrent):
                # the guesses it kept are computed again, in front of the next step's guesses
                kept = 0 if num_rejected and self.config.recurrent else sched.num_drafts - num_rejected
                request.num_computed_tokens += len(sched.token_ids) - sched.num_drafts + kept
            else:
                request.num_computed_tokens += len(sched.token_ids)
            if request.spec_token_ids:
                request.spec_token_ids = []
            status = self._append(request, token_ids)
            # after the append: kept guesses are computed tokens only once they are tokens
            bm.cache_computed_blocks(request)
            if windowed and request.request_id not in self.forks:  # its forks' first queries read further back
                bm.release_out_of_window(request.request_id, request.num_computed_tokens)
            if status is not None:
                self.finish_requests([request.request_id], status)
                finished.append(request)
        return finished

    def _append(self, request: Request, token_ids: Sequence[int]) -> RequestStatus | None:
        """Append tokens up to the first that ends the request; how it ended, if it did."""
        if len(token_ids) == 1 and not self.forks:  # (a decode's one token, the common step)
            request.output_token_ids.append(token_ids[0])
            return self._check_stop(request, token_ids[0])
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            if request.request_id in self.forks:
                self._fork(request)
            status = self._check_stop(request, token_id)
            if status is not None:
                return status
        return None

    def _fork_point(self, request: Request) -> int:
        """Where the forks of a request waiting for them start: after its prompt's full
        blocks, less the last token (0: it has none)."""
        if request.request_id not in self.forks:
            return 0
        return (request.num_prompt_tokens - 1) // self.block_manager.block_size * self.block_manager.block_size

    def _fork(self, parent: Request) -> None:
        """The parent has computed the prompt: its siblings share the prompt's full blocks and
        compute only the rest (at least one token, for their own first logits). A model with
        states saved the parent's there (reserve_state_saves), which they start from."""
        num_shared = self._fork_point(parent) // self.block_manager.block_size
        for fork in self.forks.pop(parent.request_id):
            self.block_manager.fork(parent.request_id, fork.request_id, num_shared)
            fork.num_computed_tokens = num_shared * self.block_manager.block_size
            self.waiting.insert(0, fork)

    def _release_forks(self, request: Request) -> None:
        for fork in self.forks.pop(request.request_id, []):
            self.waiting.append(fork)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = request.num_output_tokens
        if num_output >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if num_output < params.min_tokens:
            return None
        if not params.ignore_eos and token_id in self.config.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        return None


def _keep_spans_whole(request: Request, start: int, num_new: int) -> int:
    """`num_new` tokens from `start`, cut back so that the chunk ends outside each of the
    request's whole spans; 0 where it starts inside one (or at one it cannot hold)
    and cannot reach its end."""
    end = start + num_new
    for lo, hi in request.whole_spans:
        if lo < end < hi:
            if lo <= start:
                return 0
            end = lo
    return end - start
