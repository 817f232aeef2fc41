"""Paged KV-cache bookkeeping: a pool of fixed-size blocks with reference counts and a prefix
cache keyed by chained hashes of full blocks. Plain Python: no torch, no Redis.

A block holds `block_size` consecutive tokens of one sequence. A full block whose KV has been
computed is registered under the hash of (hash of the previous block, its token ids), so any
later request whose tokens start the same way reuses it instead of recomputing. Freed blocks
keep their hash and stay reusable until they are evicted, least recently used first.

The model's layers keep their KV in one or more groups of equally many layers (vLLM's hybrid
KV cache manager): a request has a block table per group, and every group takes its blocks
from the one pool (a block id names the same memory in each group's layers). A group whose
layers attend to a sliding window never reads a block again once it lies wholly before every
future query's window: such blocks go back to the pool while the request runs, for any group
to take, leaving RELEASED in the table (the runner reads any block there: attention masks
those positions). A model whose every layer is windowed has one such group; one that mixes
full and windowed layers (Gemma 2 and 3, gpt-oss) has both kinds, so only its full layers
keep a request's whole history.

With a host tier (vLLM's KV offloading), a cached block evicted from the pool is copied to
one of `num_host_blocks` slots in host memory first, under the same hash, and a later request
whose prefix continues there takes fresh blocks that the slots are copied back into before
its step runs: the prefix cache then holds what the host's memory does, not only the device's.
The copies a step needs (`take_swaps`) go out with it, evictions first. The host tier serves
models whose layers all keep every block (one group, no window), and keeps a model's saved
states too (below).

A model with linear-attention layers keeps, besides its KV, a state per request that follows
every token before (worker.model_executor.models.linear_attention): blocks alone cannot restore a prefix.
Its prefix cache also keeps states, in `state_slots` slots of their own: the state after every
`state_interval` tokens (a multiple of the block size) that a step computes, and where the
forks of an n > 1 request start, saved by the step (`ScheduledRequest.state_saves`) and keyed
by the hash of the block it ends with once the step has run. A prefix is then served up to
the last block whose state is kept, which the request's first step restores
(`ScheduledRequest.state_restore`); a fork starts from its parent's. With a host tier, a
saved state evicted from its slot goes on in a host slot (`num_host_states`), copied out
before the step that overwrites it, and a hit there takes a saved slot again, copied back
into before the step that restores it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from worker.core.request import Request

RELEASED = -1  # a block table entry whose block was given back (out of its group's window)


def host_hit(slot: int) -> int:
    """A prefix-cache hit in the host tier, as get_computed_blocks lists it among block ids."""
    return -2 - slot


def host_slot(entry: int) -> int | None:
    """The host slot a hit entry names, or None for a block id (or RELEASED)."""
    return -2 - entry if entry < RELEASED else None


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens served from the cache (either tier)
    host_hits: int = 0  # of those, tokens copied back from the host tier


@dataclass
class KVSwaps:
    """The copies a step needs before it runs, in this order: evicted blocks out to host
    slots, then host slots back into fresh blocks."""

    out: list[tuple[int, int]] = field(default_factory=list)  # (block id, host slot)
    back: list[tuple[int, int]] = field(default_factory=list)  # (host slot, block id)
    # a model with states: saved states evicted to host slots, and copied back into saved slots
    states_out: list[tuple[int, int]] = field(default_factory=list)  # (saved slot, host slot)
    states_back: list[tuple[int, int]] = field(default_factory=list)  # (host slot, saved slot)

    def __bool__(self) -> bool:
        return bool(self.out or self.back or self.states_out or self.states_back)


class SlotCache:
    """Slots of content kept by hash, least recently used first, and those not to be reused
    until the step has run (pinned): the host tier's slots of evicted blocks, and the saved
    linear-attention states."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.cached: OrderedDict[Hashable, int] = OrderedDict()  # hash -> slot
        self.free = list(range(num_slots))
        self.pinned: set[int] = set()

    def store(self, block_hash: Hashable) -> int | None:
        """A slot for an evicted block's content (None: already held, or every slot pinned)."""
        if block_hash in self.cached:
            self.cached.move_to_end(block_hash)
            return None
        slot = self.take()
        if slot is not None:
            self.cached[block_hash] = slot
        return slot

    def take(self, evicted: Callable[[Hashable, int], None] | None = None) -> int | None:
        """A slot off the books: a free one, else the least recently used one not pinned
        (its content is forgotten, once `evicted` has been told its hash and slot); None where
        every slot is pinned."""
        if self.free:
            return self.free.pop()
        victim = next((h for h, s in self.cached.items() if s not in self.pinned), None)
        if victim is None:
            return None
        slot = self.cached.pop(victim)
        if evicted is not None:
            evicted(victim, slot)
        return slot

    def can_take(self) -> bool:
        """Whether take() would give a slot (not every one pinned)."""
        return bool(self.free) or any(slot not in self.pinned for slot in self.cached.values())

    def lookup(self, block_hash: Hashable) -> int | None:
        slot = self.cached.get(block_hash)
        if slot is not None:
            self.cached.move_to_end(block_hash)
        return slot

    def reset(self) -> None:
        self.free = list(range(self.num_slots))
        self.cached.clear()


class BlockPool:
    """The blocks: reference counts, the prefix cache's keys (a block's content is its group's
    layers' KV for a run of tokens), and the free list in eviction order."""

    def __init__(self, num_blocks: int, host: SlotCache | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.host = host
        self.swaps = KVSwaps()  # the copies the step being scheduled needs
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[tuple[int, int] | None] = [None] * num_blocks  # (group, hash) once cached
        # Blocks with ref_cnt 0, in eviction order: the front is evicted first.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[tuple[int, int], int] = {}  # (group, block hash) -> block id

    def take(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block_hash = self.block_hash[block_id]
        if block_hash is not None:  # evict it from the prefix cache (to the host tier, if any)
            del self.cached[block_hash]
            self.block_hash[block_id] = None
            slot = self.host.store(block_hash) if self.host is not None else None
            if slot is not None:
                self.swaps.out.append((block_id, slot))
        self.ref_cnt[block_id] = 1
        return block_id

    def ref(self, block_id: int) -> None:
        if block_id == RELEASED:
            return
        if self.ref_cnt[block_id] == 0:
            del self.free[block_id]
        self.ref_cnt[block_id] += 1

    def unref(self, block_id: int) -> None:
        if block_id == RELEASED:
            return
        self.ref_cnt[block_id] -= 1
        if self.ref_cnt[block_id] == 0:
            self.free[block_id] = None
            if self.block_hash[block_id] is None:
                self.free.move_to_end(block_id, last=False)  # nothing to keep: reuse first

    def register(self, block_id: int, block_hash: tuple[int, int]) -> None:
        if block_id == RELEASED or self.block_hash[block_id] is not None or block_hash in self.cached:
            return  # released, registered already, or the same content is cached in another block
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id

    def reclaimed(self, hits: list[int]) -> int:
        """How many of these cache hits sit in the free list (taking them shrinks it), or
        need a free block (the host tier's)."""
        return sum(1 for b in hits if b < RELEASED or (b != RELEASED and self.ref_cnt[b] == 0))

    def pin(self, slot: int) -> None:
        assert self.host is not None
        self.host.pinned.add(slot)

    def take_back(self, slot: int) -> int:
        """A fresh block that host slot `slot` (pinned) is copied back into before the step runs."""
        block_id = self.take()
        self.swaps.back.append((slot, block_id))
        return block_id

    def take_swaps(self) -> KVSwaps:
        swaps, self.swaps = self.swaps, KVSwaps()
        if self.host is not None:
            self.host.pinned.clear()
        return swaps

    def reset_prefix_cache(self) -> None:
        for block_hash, block_id in list(self.cached.items()):
            if self.ref_cnt[block_id] == 0:
                self.block_hash[block_id] = None
                del self.cached[block_hash]
        if self.host is not None and not self.host.pinned:
            self.host.reset()


class BlockManager:
    """`windows`: each group's sliding window (None: the group keeps every block). Group 0
    keeps every block where any group does. `state_slots`: a model with linear-attention
    layers, the states its prefix cache keeps (None: a model without such layers), one after
    every `state_interval` tokens computed."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Sequence[int | None] = (None,), num_host_blocks: int = 0,
                 state_slots: int | None = None, state_interval: int = 0, num_host_states: int = 0):
        if num_host_blocks and (not enable_prefix_caching or list(windows) != [None]):
            raise ValueError("KV offloading to host memory serves the prefix cache of a model whose layers keep "
                             "every block: it needs enable_prefix_caching, and no sliding-window or chunked layers "
                             "(where they mix with full ones, disable_hybrid_kv_cache_manager keeps every layer's "
                             "blocks)")
        if state_slots is not None and (state_interval < 1 or state_interval % block_size):
            raise ValueError(f"a model with linear-attention states saves them every multiple of block_size "
                             f"({block_size}) tokens: got state_interval={state_interval}")
        # linear attention's saved states: hash of the block a state ends with -> its slot,
        # and those the step being scheduled saves (registered once it has run); with a host
        # tier, the states evicted from their slots go on in host slots of their own
        self.states = None if state_slots is None else SlotCache(state_slots)
        self.host_states = SlotCache(num_host_states) if num_host_states and state_slots else None
        self.state_interval = state_interval
        self.pending_states: dict[int, int] = {}
        self.pool = BlockPool(num_blocks, SlotCache(num_host_blocks) if num_host_blocks else None)
        self.windows = list(windows)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[list[int]]] = {}  # request id -> a block table per group
        self.num_released: dict[str, list[int]] = {}  # request id -> leading entries released, per group
        self.num_registered: dict[str, list[int]] = {}  # request id -> leading blocks offered to the cache, per group
        self.cache_epoch = 0  # resets so far (reset_prefix_cache): part of every block's hash
        self._windowed = any(window is not None for window in self.windows)
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free)

    @property
    def windowed(self) -> bool:
        """Some group's layers attend to a window: its blocks behind it go back (release_out_of_window)."""
        return self._windowed

    @property
    def usage(self) -> float:
        return 1.0 - len(self.pool.free) / self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """Group 0's table."""
        return self.block_tables(request_id)[0]

    def block_tables(self, request_id: str) -> list[list[int]]:
        return self.req_blocks.get(request_id) or [[] for _ in self.windows]

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks, over every group, that a request of `num_tokens` holds once computed."""
        return sum(self._table_len(num_tokens) - self.first_read_block(g, num_tokens) for g in range(len(self.windows)))

    def num_held(self, request_id: str) -> int:
        return sum(len(table) for table in self.req_blocks.get(request_id, [])) - sum(
            self.num_released.get(request_id, []))

    def first_read_block(self, group: int, num_computed: int) -> int:
        """The first block of `group` that the query at `num_computed` may read."""
        window = self.windows[group]
        return 0 if window is None else max(num_computed - window, 0) // self.block_size

    def get_computed_blocks(self, request: Request) -> list[list[int]]:
        """Cached blocks, per group, that hold a prefix of the request's tokens: every group
        has them up to the same block, a windowed group from its window's first block on
        (RELEASED before it).

        At least one token is always left to compute, so the step still produces logits.
        """
        none: list[list[int]] = [[] for _ in self.windows]
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return none  # prompt logprobs need every prompt position computed
        self._hash_full_blocks(request)
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        found = [[self.pool.cached.get((group, h)) for h in hashes] for group in range(len(self.windows))]
        num_hit = len(hashes)
        for group, blocks in enumerate(found):
            if self.windows[group] is None:  # the whole prefix
                num_hit = min(num_hit, blocks.index(None) if None in blocks else len(blocks))
        runs = [_runs(blocks) for blocks in found]  # cached blocks in a row, ending at each
        while num_hit > 0 and not (all(
            runs[group][num_hit - 1] >= num_hit - self.first_read_block(group, num_hit * self.block_size)
            for group in range(len(self.windows)) if self.windows[group] is not None
        ) and self._state_kept(hashes, num_hit)):
            num_hit -= 1
        self.stats.queries += request.num_tokens
        hits = []
        for group, blocks in enumerate(found):
            first = self.first_read_block(group, num_hit * self.block_size)
            hits.append([RELEASED] * first + [b for b in blocks[first:num_hit] if b is not None])
        host = self.pool.host
        if host is not None:  # the prefix goes on in the host tier (one group, no window)
            more = 0
            while num_hit + more < len(hashes) and (0, hashes[num_hit + more]) in host.cached:
                more += 1
            while more and not self._state_kept(hashes, num_hit + more):  # (to a block whose state is kept)
                more -= 1
            for block_hash in hashes[num_hit:num_hit + more]:
                slot = host.lookup((0, block_hash))  # (a hit counts as use)
                assert slot is not None  # (held, as counted above)
                hits[0].append(host_hit(slot))
                self.stats.host_hits += self.block_size
        self.stats.hits += len(hits[0]) * self.block_size
        return hits

    def _state_kept(self, hashes: list[int], num_blocks: int) -> bool:
        """The linear-attention state after the first `num_blocks` blocks is kept, in a saved
        slot, or in a host slot while a saved slot is left to copy it back into (always true of
        a model without such layers)."""
        if self.states is None:
            return True
        block_hash = hashes[num_blocks - 1]
        return block_hash in self.states.cached or (self.host_states is not None and block_hash in self.host_states.cached
                                                    and self.states.can_take())

    def saved_state(self, request: Request, num_computed: int) -> int | None:
        """The slot of the kept state a request admitted with its first `num_computed` tokens
        computed (a prefix-cache hit, or a fork's share of its parent's prompt) starts from;
        None where it starts from nothing, or no such state is kept."""
        if self.states is None or num_computed == 0:
            return None
        self._hash_full_blocks(request)
        block_hash = request.block_hashes[num_computed // self.block_size - 1]
        slot = self.states.lookup(block_hash)
        if slot is not None or self.host_states is None:
            return slot
        host_slot = self.host_states.lookup(block_hash)
        if host_slot is None:
            return None
        # the state is copied back into a saved slot before the step runs: until then no state
        # evicted (this one's slot's first) may take its host slot, nor a save the saved slot
        self.host_states.pinned.add(host_slot)
        slot = self._take_state_slot()
        if slot is None:
            return None
        self.states.cached[block_hash] = slot
        self.states.pinned.add(slot)
        self.pool.swaps.states_back.append((host_slot, slot))
        return slot

    def _take_state_slot(self) -> int | None:
        """A saved slot for a state: free, or the least recently used one's, which goes on in
        the host tier where there is one (copied out before the step runs)."""
        assert self.states is not None

        def to_host(block_hash: Hashable, slot: int) -> None:
            if self.host_states is not None and (host_slot := self.host_states.store(block_hash)) is not None:
                self.pool.swaps.states_out.append((slot, host_slot))

        return self.states.take(to_host)

    def reserve_state_saves(self, request: Request, start: int, end: int, also: int = 0
                            ) -> tuple[tuple[int, int], ...]:
        """Slots for the states that a step computing the request's positions [start, end)
        passes every `state_interval` tokens (and after `also` tokens, a multiple of the block
        size: where its forks start), as (tokens before, slot) each; none where the cache keeps
        that state already (or saves it this step), or no slot is left."""
        if self.states is None or not self.enable_prefix_caching:
            return ()
        self._hash_full_blocks(request)
        saves = []
        boundaries = set(range((start // self.state_interval + 1) * self.state_interval, end + 1, self.state_interval))
        if start < also <= end:
            boundaries.add(also)
        for num_tokens in sorted(boundaries):
            block_hash = request.block_hashes[num_tokens // self.block_size - 1]
            if self.states.lookup(block_hash) is not None or block_hash in self.pending_states:
                continue
            slot = self._take_state_slot()
            if slot is None:
                break
            self.pending_states[block_hash] = slot
            saves.append((num_tokens, slot))
        return tuple(saves)

    def settle_state_saves(self, written: Iterable[int]) -> None:
        """The states saved into these slots are written (their step ran): the cache keeps
        them. Other slots reserved for saves go back, unwritten (their request left the step)."""
        if self.states is None:
            return
        written = set(written)
        for block_hash, slot in self.pending_states.items():
            if slot in written:
                self.states.cached[block_hash] = slot
            else:
                self.states.free.append(slot)
        self.pending_states.clear()

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[list[int]] | None = None
    ) -> bool:
        """Give the request room for `num_new_tokens` more tokens in every group; False (and
        no change) if the pool cannot. `computed_blocks` are prefix-cache hits (per group,
        from `get_computed_blocks`) taken over by a new request."""
        tables = self.req_blocks.get(request.request_id)
        if tables is not None and not computed_blocks:
            room = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
            if len(tables[0]) >= room and (len(tables) == 1 or all(len(table) >= room for table in tables)):
                return True  # most decode steps: the last block has room
        hits = computed_blocks or [[] for _ in self.windows]
        tables = self.req_blocks.setdefault(request.request_id, [[] for _ in self.windows])
        num_tokens = request.num_computed_tokens + len(hits[0]) * self.block_size + num_new_tokens
        new = [max(self._table_len(num_tokens) - len(table) - len(hit), 0) for table, hit in zip(tables, hits, strict=True)]
        if sum(new) > len(self.pool.free) - sum(self.pool.reclaimed(hit) for hit in hits):
            return False
        for group, (table, hit, n) in enumerate(zip(tables, hits, new, strict=True)):
            for block_id in hit:
                if (slot := host_slot(block_id)) is not None:  # kept until copied back: no eviction reuses it
                    self.pool.pin(slot)
                else:
                    self.pool.ref(block_id)
            # (the host tier's hits take blocks last: a block taken may evict another's cached one)
            table.extend(block_id if (slot := host_slot(block_id)) is None else self.pool.take_back(slot)
                         for block_id in hit)
            table.extend(self.pool.take() for _ in range(n))
            released = hit.count(RELEASED)
            if released:
                self.num_released.setdefault(request.request_id, [0] * len(self.windows))[group] = released
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache.

        Called after the step that computed them, never at allocation: a block registered
        before its KV is written could be handed to another request with garbage in it if its
        owner were preempted first.
        """
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        done = self.num_registered.get(request.request_id)
        if (done is not None and min(done) >= num_full
                and len(request.block_hashes) >= request.num_tokens // self.block_size):
            return  # most decode steps: no block filled up, none to hash
        self._hash_full_blocks(request)
        if done is None:
            done = self.num_registered[request.request_id] = [0] * len(self.windows)
        if min(done) >= num_full:
            return
        for group, table in enumerate(self.block_tables(request.request_id)):
            num_full = min(request.num_computed_tokens // self.block_size, len(table))
            for i in range(done[group], num_full):  # each block once: not the whole table every step
                self.pool.register(table[i], (group, request.block_hashes[i]))
            done[group] = max(done[group], num_full)

    def free_request(self, request_id: str) -> None:
        """Release a request's blocks. Tail blocks are queued for eviction before head blocks,
        since heads (system prompts, shared prefixes) are the likeliest to be reused."""
        tables = self.req_blocks.pop(request_id, [])
        self.num_released.pop(request_id, None)
        self.num_registered.pop(request_id, None)
        for table in tables:
            for block_id in reversed(table):
                self.pool.unref(block_id)

    def release_out_of_window(self, request_id: str, num_computed: int) -> int:
        """Give back the blocks of windowed groups that the query at `num_computed` and every
        later one will not read; returns how many were released."""
        if not self._windowed:
            return 0
        tables = self.req_blocks.get(request_id)
        if tables is None:
            return 0
        released = self.num_released.setdefault(request_id, [0] * len(self.windows))
        count = 0
        for group, table in enumerate(tables):
            if self.windows[group] is None:
                continue
            end = min(self.first_read_block(group, num_computed), len(table))
            for i in range(released[group], end):
                self.pool.unref(table[i])
                table[i] = RELEASED
                count += 1
            released[group] = max(released[group], end)
        return count

    def fork(self, parent_id: str, child_id: str, num_blocks: int) -> None:
        """Share the parent's first `num_blocks` blocks with a child (n > 1 completions),
        in a windowed group only those the child's first query reads."""
        tables, released = [], []
        for group, table in enumerate(self.req_blocks[parent_id]):
            first = self.first_read_block(group, num_blocks * self.block_size)
            assert RELEASED not in table[first:num_blocks], "the parent gave back blocks its child reads"
            shared = [RELEASED] * first + table[first:num_blocks]
            for block_id in shared:
                self.pool.ref(block_id)
            tables.append(shared)
            released.append(first)
        self.req_blocks[child_id] = tables
        self.num_released[child_id] = released

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: the blocks (and saved states) no request holds now, and
        those running requests hold too, as far as later requests can tell: every later
        request's blocks hash apart from them (a new first parent), so neither they nor any
        block a running request adds to its table is ever a hit."""
        self.cache_epoch += 1
        self.pool.reset_prefix_cache()
        if self.states is not None:
            self.pending_states.clear()
            self.states.reset()
        if self.host_states is not None and not self.host_states.pinned:
            self.host_states.reset()

    def take_swaps(self) -> KVSwaps:
        """The copies the step just scheduled needs (KV offloading), and the slots free again."""
        for cache in (self.states, self.host_states):
            if cache is not None:
                cache.pinned.clear()
        return self.pool.take_swaps()

    def _table_len(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hash_full_blocks(self, request: Request) -> None:
        bs = self.block_size
        for i in range(len(request.block_hashes), request.num_tokens // bs):
            # the first block's parent names the adapter (its KV differs from the base model's)
            # and the cache salt (only requests with the same salt share blocks)
            parent = request.block_hashes[i - 1] if i else _first_parent(request, self.cache_epoch)
            key = (parent, tuple(request.token_slice(i * bs, (i + 1) * bs)))
            # a block holding image tokens names those images' pixels: equal placeholders differ
            images = tuple(digest for offset, length, digest in request.image_spans
                           if offset < (i + 1) * bs and offset + length > i * bs)
            request.block_hashes.append(hash((*key, images) if images else key))


def _first_parent(request: Request, cache_epoch: int) -> Hashable:
    if request.cache_salt is not None:
        parent: Hashable = ("salt", request.cache_salt, request.lora_id)
    else:
        parent = ("lora", request.lora_id) if request.lora_id else None
    return ("epoch", cache_epoch, parent) if cache_epoch else parent


def _runs(blocks: list[int | None]) -> list[int]:
    """For each index, how many entries up to it in a row are cached (not None)."""
    runs, run = [], 0
    for block_id in blocks:
        run = run + 1 if block_id is not None else 0
        runs.append(run)
    return runs
