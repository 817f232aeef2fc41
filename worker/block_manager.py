"""Paged KV-cache bookkeeping: a pool of fixed-size blocks with reference counts and a prefix
cache keyed by chained hashes of full blocks. Plain Python: no torch, no Redis.

A block holds `block_size` consecutive tokens of one sequence. A full block whose KV has been
computed is registered under the hash of (hash of the previous block, its token ids), so any
later request whose tokens start the same way reuses it instead of recomputing. Freed blocks
keep their hash and stay reusable until they are evicted, least recently used first.

A model whose every layer attends to a sliding window never reads a block again once it lies
wholly before every future query's window: `release_before` gives such blocks back while the
request runs, leaving RELEASED in its table (the runner reads any block there: attention
masks those positions).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from worker.request import Request

RELEASED = -1  # a block table entry whose block was given back (`release_before`)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens served from the cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Blocks with ref_cnt 0, in eviction order: the front is evicted first.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.req_blocks: dict[str, list[int]] = {}
        self.num_released: dict[str, int] = {}  # request id -> leading table entries released
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks that hold a prefix of the request's tokens.

        At least one token is always left to compute, so the step still produces logits.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        self._hash_full_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hits) * self.block_size
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Give the request room for `num_new_tokens` more tokens; False (and no change) if the
        pool cannot. `computed_blocks` are prefix-cache hits taken over by a new request."""
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_tokens = (
            request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        )
        num_new_blocks = self.blocks_needed(num_tokens) - len(blocks) - len(computed_blocks)
        # Hits that sit in the free list are about to be taken out of it.
        num_reclaimed = sum(1 for b in computed_blocks if self.ref_cnt[b] == 0)
        if num_new_blocks > len(self.free) - num_reclaimed:
            return False
        for block_id in computed_blocks:
            if self.ref_cnt[block_id] == 0:
                del self.free[block_id]
            self.ref_cnt[block_id] += 1
        blocks.extend(computed_blocks)
        for _ in range(max(num_new_blocks, 0)):
            blocks.append(self._take_free_block())
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache.

        Called after the step that computed them, never at allocation: a block registered
        before its KV is written could be handed to another request with garbage in it if its
        owner were preempted first.
        """
        if not self.enable_prefix_caching:
            return
        self._hash_full_blocks(request)
        blocks = self.req_blocks.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        for i in range(num_full):
            block_id = blocks[i]
            if block_id == RELEASED or self.block_hash[block_id] is not None:
                continue
            block_hash = request.block_hashes[i]
            if block_hash in self.cached:
                continue  # the same content is cached in another block; keep that one
            self.block_hash[block_id] = block_hash
            self.cached[block_hash] = block_id

    def free_request(self, request_id: str) -> None:
        """Release a request's blocks. Tail blocks are queued for eviction before head blocks,
        since heads (system prompts, shared prefixes) are the likeliest to be reused."""
        blocks = self.req_blocks.pop(request_id, [])
        self.num_released.pop(request_id, None)
        for block_id in reversed(blocks):
            self._unref(block_id)

    def release_before(self, request_id: str, position: int) -> int:
        """Give back the request's blocks that hold only positions before `position` (no
        future query of a sliding-window model reads them); returns how many were released."""
        blocks = self.req_blocks.get(request_id, [])
        start = self.num_released.get(request_id, 0)
        end = min(max(position, 0) // self.block_size, len(blocks))
        for i in range(start, end):
            self._unref(blocks[i])
            blocks[i] = RELEASED
        if end > start:
            self.num_released[request_id] = end
        return max(end - start, 0)

    def fork(self, parent_id: str, child_id: str, num_blocks: int) -> None:
        """Share the parent's first `num_blocks` blocks with a child (n > 1 completions)."""
        shared = self.req_blocks[parent_id][:num_blocks]
        for block_id in shared:
            if block_id != RELEASED:
                self.ref_cnt[block_id] += 1
        self.req_blocks[child_id] = list(shared)
        released = min(self.num_released.get(parent_id, 0), num_blocks)
        if released:
            self.num_released[child_id] = released

    def _unref(self, block_id: int) -> None:
        if block_id == RELEASED:
            return
        self.ref_cnt[block_id] -= 1
        if self.ref_cnt[block_id] == 0:
            self.free[block_id] = None
            if self.block_hash[block_id] is None:
                self.free.move_to_end(block_id, last=False)  # nothing to keep: reuse first

    def reset_prefix_cache(self) -> None:
        for block_hash, block_id in list(self.cached.items()):
            if self.ref_cnt[block_id] == 0:
                self.block_hash[block_id] = None
                del self.cached[block_hash]

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block_hash = self.block_hash[block_id]
        if block_hash is not None:  # evict it from the prefix cache
            del self.cached[block_hash]
            self.block_hash[block_id] = None
        self.ref_cnt[block_id] = 1
        return block_id

    def _hash_full_blocks(self, request: Request) -> None:
        bs = self.block_size
        for i in range(len(request.block_hashes), request.num_tokens // bs):
            # the first block's parent names the adapter: its KV differs from the base model's
            parent = request.block_hashes[i - 1] if i else ("lora", request.lora_id) if request.lora_id else None
            request.block_hashes.append(hash((parent, tuple(request.token_slice(i * bs, (i + 1) * bs)))))
