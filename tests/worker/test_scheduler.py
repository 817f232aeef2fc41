"""Scheduler and block manager, without torch: these modules must stay plain Python."""

from __future__ import annotations

import subprocess
import sys

import pytest

from producer.sampling_params import SamplingParams
from worker.config import SchedulerConfig
from worker.core.block_manager import BlockManager, KVSwaps, host_hit, host_slot
from worker.core.request import Request, RequestStatus
from worker.core.scheduler import Scheduler

BS = 4


def make_scheduler(num_blocks=16, max_num_seqs=8, budget=64, policy="fcfs", prefix=True, max_model_len=256):
    bm = BlockManager(num_blocks, BS, prefix)
    cfg = SchedulerConfig(max_num_seqs, budget, max_model_len, policy, frozenset({2}))
    return Scheduler(cfg, bm)


def make_request(rid, prompt, max_tokens=8, priority=0, arrival=0.0, **params):
    r = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), priority=priority, arrival_time=arrival)
    r.max_tokens = max_tokens
    return r


def step(sched, token=7):
    """One schedule + update with a fixed sampled token for every sampling request. The step's
    tables are kept as the runner reads them, before the update (which may release entries
    behind a window in the block manager's lists, which the step holds)."""
    out = sched.schedule()
    for s in out.scheduled:
        s.block_table, s.group_tables = list(s.block_table), tuple(list(table) for table in s.group_tables)
    sampled = {s.request_id: [token] for s in out.scheduled if s.sample}
    finished = sched.update_from_output(out, sampled)
    return out, finished


def test_plain_python_no_torch():
    code = "import sys, worker.core.scheduler, worker.core.block_manager; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prefill_then_decode_and_length_finish():
    sched = make_scheduler()
    sched.add_request(make_request("a", range(10, 20), max_tokens=3))
    out, _ = step(sched)
    assert [(s.request_id, len(s.token_ids), s.start_pos, s.sample) for s in out.scheduled] == [("a", 10, 0, True)]
    out, _ = step(sched)
    assert [(len(s.token_ids), s.start_pos) for s in out.scheduled] == [(1, 10)]
    out, finished = step(sched)
    assert [r.request_id for r in finished] == ["a"]
    assert finished[0].status == RequestStatus.FINISHED_LENGTH
    assert finished[0].output_token_ids == [7, 7, 7]
    assert sched.block_manager.num_free_blocks == 16
    assert not sched.has_unfinished_requests()


def test_chunked_prefill_shares_budget_with_decodes():
    sched = make_scheduler(budget=6)
    sched.add_request(make_request("a", range(10, 13)))
    sched.add_request(make_request("b", range(20, 34), arrival=1.0))
    out, _ = step(sched)
    assert [(s.request_id, len(s.token_ids), s.sample) for s in out.scheduled] == [("a", 3, True), ("b", 3, False)]
    out, _ = step(sched)
    # the decode goes first, then b's next chunk takes the rest of the budget
    assert [(s.request_id, len(s.token_ids), s.start_pos) for s in out.scheduled] == [("a", 1, 3), ("b", 5, 3)]
    assert out.num_batched_tokens == 6


def test_eos_and_stop_token_and_min_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("eos", [5, 6]))
    sched.add_request(make_request("ignore", [5, 6], ignore_eos=True))
    sched.add_request(make_request("stopid", [5, 6], stop_token_ids=[9]))
    sched.add_request(make_request("min", [5, 6], min_tokens=2))
    out = sched.schedule()
    finished = sched.update_from_output(out, {"eos": [2], "ignore": [2], "stopid": [9], "min": [2]})
    assert sorted(r.request_id for r in finished) == ["eos", "stopid"]
    assert sched.finished["stopid"].stop_reason == 9
    out = sched.schedule()
    finished = sched.update_from_output(out, {"ignore": [2], "min": [2]})
    assert [r.request_id for r in finished] == ["min"]


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [1, 2, 3], arrival=i))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2"]


def test_priority_policy_orders_and_preempts_lowest():
    sched = make_scheduler(num_blocks=4, policy="priority", budget=100)
    sched.add_request(make_request("low", range(8), priority=5, arrival=0, max_tokens=20))
    sched.add_request(make_request("high", range(8), priority=0, arrival=1, max_tokens=20))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["high", "low"]  # lower value first
    # Both hold 2 full blocks; the next token needs a third block each and the pool is empty.
    out, _ = step(sched)
    assert out.preempted == ["low"]
    assert [s.request_id for s in out.scheduled] == ["high"]
    assert sched.waiting[0].request_id == "low" and sched.waiting[0].num_computed_tokens == 0


def test_fcfs_preempts_latest_and_recomputes_output():
    sched = make_scheduler(num_blocks=5, budget=100, prefix=False)
    sched.add_request(make_request("a", range(8), arrival=0, max_tokens=6))
    sched.add_request(make_request("b", range(100, 108), arrival=1, max_tokens=6))
    step(sched)  # both prefill: 2 blocks each, 1 free
    step(sched)  # a takes the free block for token 9; b needs one more: b is preempted
    assert sched.num_preemptions == 1
    b = sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.output_token_ids == [7]
    while sched.has_unfinished_requests():
        out, _ = step(sched)
    # b resumed by recomputing its prompt plus the token it had produced
    assert sched.finished["b"].output_token_ids == [7] * 6
    assert sched.block_manager.num_free_blocks == 5


def test_abort_frees_blocks_at_once():
    sched = make_scheduler()
    sched.add_request(make_request("a", range(12)))
    sched.add_request(make_request("w", range(12)))
    step(sched)
    assert sched.block_manager.num_free_blocks == 16 - 2 * 3  # 12 prompt tokens: 3 blocks each
    sched.abort_requests(["a", "w", "unknown"])
    assert sched.block_manager.num_free_blocks == 16
    assert sched.finished["a"].status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests()


def test_prefix_cache_reuses_full_blocks():
    sched = make_scheduler()
    shared = list(range(50, 62))  # 3 full blocks
    sched.add_request(make_request("a", shared + [1, 2]))
    step(sched)
    sched.add_request(make_request("b", shared + [3]))
    out, _ = step(sched)
    b = next(s for s in out.scheduled if s.request_id == "b")
    assert b.start_pos == 12 and b.token_ids == [3]
    assert sched.requests["b"].num_cached_tokens == 12
    a_blocks = sched.block_manager.block_table("a")
    assert sched.block_manager.block_table("b")[:3] == a_blocks[:3]


def test_prefix_cache_leaves_one_token_and_survives_free():
    sched = make_scheduler()
    prompt = list(range(50, 58))  # exactly 2 blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    step(sched)
    assert not sched.has_unfinished_requests()
    sched.add_request(make_request("b", prompt, max_tokens=1))
    out, _ = step(sched)
    # block 1 is cached, but the last block is recomputed so the step still has a token to sample
    assert out.scheduled[0].start_pos == 4 and out.scheduled[0].token_ids == prompt[4:]


def test_lru_eviction_of_cached_blocks():
    bm = BlockManager(4, BS, True)
    a = make_request("a", range(8))
    assert bm.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    bm.cache_computed_blocks(a)
    bm.free_request("a")
    assert bm.num_free_blocks == 4 and len(bm.pool.cached) == 2
    # Two uncached blocks are handed out before the cached ones; then the cached tail goes first.
    b = make_request("b", range(100, 112))
    assert bm.allocate_slots(b, 12)
    assert len(bm.pool.cached) == 1  # the tail block of a was evicted, its head survives
    c = make_request("c", list(range(4)) + [99, 98])
    assert [len(hits) for hits in bm.get_computed_blocks(c)] == [1]


def _computed_and_freed(bm, request):
    """A request's blocks computed, cached and given back."""
    assert bm.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    bm.cache_computed_blocks(request)
    bm.free_request(request.request_id)


def test_blocks_evicted_to_the_host_tier_come_back_on_a_hit():
    """Four blocks on the device, four host slots: a's cached blocks, evicted by b, are copied
    out (before b's step overwrites them); a's prompt again takes fresh blocks that its host
    slots are copied back into, after this step's own evictions."""
    bm = BlockManager(4, BS, True, num_host_blocks=4)
    _computed_and_freed(bm, make_request("a", range(12)))  # 3 full blocks cached
    assert bm.take_swaps() == KVSwaps()
    a_blocks = {h: b for h, b in bm.pool.cached.items()}
    _computed_and_freed(bm, make_request("b", range(100, 116)))  # takes all 4: a's 3 go to the host
    swaps = bm.take_swaps()
    assert sorted(block for block, _ in swaps.out) == sorted(a_blocks.values()) and not swaps.back
    slot_of = {bm.pool.host.cached[h]: a_blocks[h] for h in a_blocks}  # slot -> a's block it holds
    again = make_request("a2", list(range(12)) + [5])
    hits = bm.get_computed_blocks(again)
    assert [host_slot(entry) for entry in hits[0]] == [bm.pool.host.cached[(0, h)] for h in again.block_hashes[:3]]
    assert bm.stats.host_hits == 12
    assert bm.allocate_slots(again, 1, hits)
    swaps = bm.take_swaps()
    # b's 4 cached blocks go to the host as a2 takes them, each into the one slot a's 3 (being
    # copied back from) leave: it ends with the last
    assert [slot for slot, _ in swaps.back] == [host_slot(e) for e in hits[0]]
    assert [block for _, block in swaps.back] == bm.block_table("a2")[:3]
    (spare,) = set(range(4)) - set(slot_of)
    assert [slot for _, slot in swaps.out] == [spare] * 4 and len(bm.pool.host.cached) == 4
    assert bm.pool.host.pinned == set()  # reusable again once the step has its copies


def test_the_host_tier_keeps_the_latest_and_refuses_what_it_cannot_serve():
    bm = BlockManager(2, BS, True, num_host_blocks=1)
    _computed_and_freed(bm, make_request("a", range(4)))
    _computed_and_freed(bm, make_request("b", range(10, 18)))  # evicts a's block: slot 0 holds it
    _computed_and_freed(bm, make_request("c", range(20, 28)))  # evicts b's two, tail first
    swaps = bm.take_swaps()
    assert [slot for _, slot in swaps.out] == [0, 0, 0] and len(bm.pool.host.cached) == 1
    assert bm.get_computed_blocks(make_request("b2", list(range(10, 18)) + [1])) == [[host_hit(0)]]  # b's head
    for windows, prefix in (((8,), True), ((None,), False)):
        with pytest.raises(ValueError, match="needs enable_prefix_caching, and no sliding-window or chunked layers"):
            BlockManager(4, BS, prefix, windows=windows, num_host_blocks=4)


def test_allocation_failure_changes_nothing():
    bm = BlockManager(2, BS, True)
    r = make_request("r", range(20))
    assert not bm.allocate_slots(r, 20)
    assert bm.num_free_blocks == 2


def test_fork_shares_prompt_blocks_by_reference():
    sched = make_scheduler()
    parent = make_request("p#0", range(10), max_tokens=4)
    forks = [make_request(f"p#{i}", range(10), max_tokens=4) for i in (1, 2)]
    sched.add_request(parent, forks=forks)
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["p#0"]
    out, _ = step(sched)
    forked = {s.request_id: s for s in out.scheduled if s.request_id != "p#0"}
    assert sorted(forked) == ["p#1", "p#2"]
    assert all(s.start_pos == 8 and s.token_ids == [8, 9] for s in forked.values())
    bm = sched.block_manager
    shared = bm.block_table("p#0")[:2]
    assert bm.block_table("p#1")[:2] == shared and bm.block_table("p#2")[:2] == shared
    assert all(bm.pool.ref_cnt[b] == 3 for b in shared)


def make_lora_request(rid, prompt, lora_id, arrival=0.0, max_tokens=8):
    r = make_request(rid, prompt, max_tokens=max_tokens, arrival=arrival)
    r.lora_id = lora_id
    return r


def test_adapters_running_at_once_are_capped_by_max_loras():
    bm = BlockManager(32, BS, True)
    sched = Scheduler(SchedulerConfig(8, 64, 256, "fcfs", frozenset({2}), max_loras=1), bm)
    for i, lora_id in enumerate([1, 2, 1, 0, 2]):
        sched.add_request(make_lora_request(f"r{i}", range(10, 14), lora_id, arrival=float(i), max_tokens=2))
    out, _ = step(sched)
    # adapter 2 waits for the only slot; requests behind it with adapter 1 or none go ahead
    assert [(s.request_id, s.lora_id) for s in out.scheduled] == [("r0", 1), ("r2", 1), ("r3", 0)]
    seen = [out]
    while sched.has_unfinished_requests():
        seen.append(step(sched)[0])
        running = {r.lora_id for r in sched.running if r.lora_id}
        assert len(running) <= 1
    assert {s.request_id for out in seen for s in out.scheduled} == {f"r{i}" for i in range(5)}
    assert [s.request_id for s in seen[2].scheduled] == ["r1", "r4"]  # once adapter 1 finished


def test_prefix_cache_keeps_adapters_apart():
    sched = Scheduler(SchedulerConfig(8, 64, 256, "fcfs", frozenset({2}), max_loras=2), BlockManager(32, BS, True))
    shared = list(range(50, 62))  # 3 full blocks
    sched.add_request(make_lora_request("base", shared + [1], 0))
    step(sched)
    # the same tokens under an adapter have other KV: no hit, until the adapter computed them
    sched.add_request(make_lora_request("a1", shared + [2], 1))
    out, _ = step(sched)
    assert [(s.request_id, s.start_pos) for s in out.scheduled if s.request_id == "a1"] == [("a1", 0)]
    sched.add_request(make_lora_request("a1-again", shared + [3], 1))
    sched.add_request(make_lora_request("a2", shared + [4], 2))
    step(sched)
    assert sched.requests["a1-again"].num_cached_tokens == 12
    assert sched.requests["a2"].num_cached_tokens == 0


def test_guesses_are_dropped_before_anyone_is_preempted():
    sched = make_scheduler(num_blocks=4, budget=64)  # 16 token slots
    sched.add_request(make_request("a", range(10, 17), max_tokens=8))  # 7 tokens: 2 blocks
    sched.add_request(make_request("b", range(20, 27), max_tokens=8, arrival=1.0))  # 2 blocks
    step(sched)
    a = sched.requests["a"]
    a.spec_token_ids = [1, 2, 3, 4, 5, 6, 7, 8]  # would need a third block for a, taking b's
    out, _ = step(sched)
    assert sched.num_preemptions == 0 and {s.request_id for s in out.scheduled} == {"a", "b"}
    assert [s.num_drafts for s in out.scheduled if s.request_id == "a"] == [0]


def make_window_scheduler(window, num_blocks=16, budget=64):
    bm = BlockManager(num_blocks, BS, True, windows=[window])
    return Scheduler(SchedulerConfig(8, budget, 256, "fcfs", frozenset({2})), bm)


def test_a_window_model_gives_back_blocks_no_query_will_read():
    """Every layer sees its last 6 positions: once a request has computed n tokens, its next
    query (at n) reads positions n - 5 .. n, and blocks wholly before n - 6 are given back,
    their table entries marked released (read as block 0, which attention masks)."""
    sched = make_window_scheduler(window=6, budget=8)
    sched.add_request(make_request("a", range(10, 30), max_tokens=12))  # 20 prompt tokens
    out, _ = step(sched)  # the first 8 prompt tokens
    bm = sched.block_manager
    assert out.scheduled[0].token_ids == list(range(10, 18)) and bm.num_released["a"] == [0]  # 8 - 6 < 4
    out, _ = step(sched)  # tokens 8..15: 16 computed; blocks before 16 - 6 = 10: blocks 0 and 1
    assert bm.block_table("a")[:2] == [-1, -1] and bm.num_free_blocks == 16 - 2
    out, _ = step(sched)  # the last 4 prompt tokens, attending back to position 10
    assert out.scheduled[0].start_pos == 16 and out.scheduled[0].tables()[0][:2] == [0, 0]
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        held = [b for b in bm.block_table("a") if b != -1]
        assert len(held) <= 3  # the window (6) and the next token span at most 3 blocks of 4
    assert bm.num_free_blocks == 16 and all(c == 0 for c in bm.pool.ref_cnt)


def test_released_blocks_stay_in_the_prefix_cache_and_forks_skip_them():
    sched = make_window_scheduler(window=4, budget=64)
    prompt = list(range(10, 30))
    parent = make_request("p#0", prompt, max_tokens=3)
    sched.add_request(parent, forks=[make_request("p#1", prompt, max_tokens=3)])
    step(sched)  # the whole prompt: 20 computed, blocks before 16 released
    bm = sched.block_manager
    assert bm.block_table("p#0")[:4] == [-1] * 4
    step(sched)  # the fork joins, sharing the prompt's full blocks: released ones stay released
    assert bm.block_table("p#1")[:4] == [-1] * 4
    while sched.has_unfinished_requests():
        step(sched)
    assert all(c == 0 for c in bm.pool.ref_cnt)
    # the released prompt blocks were cached when computed: a new request finds the prefix,
    # taking only the blocks its next query's window reads (positions 12.. of 16)
    again = make_request("b", prompt, max_tokens=1)
    [hits] = bm.get_computed_blocks(again)
    assert len(hits) == 4 and hits[:3] == [-1] * 3 and hits[3] != -1


def test_a_chunked_prompt_keeps_the_blocks_its_forks_will_read():
    """The parent's prompt in chunks of 19: after the first chunk the window (7) would let
    blocks go that the fork's first query (at 16) still reads (positions 10 on): a parent
    with forks to come gives nothing back until they have their share."""
    sched = make_window_scheduler(window=7, budget=19)
    prompt = list(range(10, 30))  # 20 tokens: the fork computes from 16
    sched.add_request(make_request("p#0", prompt, max_tokens=3), forks=[make_request("p#1", prompt, max_tokens=3)])
    bm = sched.block_manager
    step(sched)  # 19 prompt tokens
    held = list(bm.block_table("p#0"))
    assert -1 not in held
    step(sched)  # the last prompt token: the fork is made, then the parent gives back
    out, _ = step(sched)
    [child] = [s for s in out.scheduled if s.request_id == "p#1"]
    first = bm.first_read_block(0, child.start_pos)  # block 2: positions 8..11, of which 10 and 11 are read
    assert (child.start_pos, first) == (16, 2) and child.block_table[first:4] == held[first:4]
    while sched.has_unfinished_requests():
        step(sched)
    assert all(c == 0 for c in bm.pool.ref_cnt)


def test_without_a_window_nothing_is_given_back():
    sched = make_window_scheduler(window=None)
    sched.add_request(make_request("a", range(10, 30), max_tokens=4))
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        assert -1 not in sched.block_manager.block_table("a")


def make_hybrid_scheduler(window=6, num_blocks=32, budget=64):
    """Full layers in group 0, layers with a window of `window` in group 1 (Gemma 2, gpt-oss),
    both taking blocks from one pool."""
    bm = BlockManager(num_blocks, BS, True, windows=[None, window])
    return Scheduler(SchedulerConfig(8, budget, 256, "fcfs", frozenset({2})), bm)


def test_hybrid_groups_keep_the_full_layers_blocks_and_give_back_the_windowed_ones():
    sched = make_hybrid_scheduler(budget=8)
    sched.add_request(make_request("a", range(10, 30), max_tokens=12))  # 20 prompt tokens
    bm = sched.block_manager
    step(sched)
    out, _ = step(sched)  # 16 computed: the windowed group's blocks before 16 - 6 = 10 go back
    full, windowed = (list(table) for table in bm.block_tables("a"))
    assert -1 not in full and len(full) == 4 and windowed[:2] == [-1, -1] and len(windowed) == 4
    assert bm.num_free_blocks == 32 - 4 - 2 and bm.num_held("a") == 6
    out, _ = step(sched)
    [s] = out.scheduled  # released entries read block 0
    assert s.tables()[0][:4] == full and s.tables()[1][:4] == [0, 0, *windowed[2:]]
    while sched.has_unfinished_requests():
        step(sched)
        full, windowed = bm.block_tables("a") if "a" in bm.req_blocks else (full, windowed)
        assert -1 not in full and len([b for b in windowed if b != -1]) <= 3
    assert bm.num_free_blocks == 32 and all(c == 0 for c in bm.pool.ref_cnt)


def test_a_hybrid_allocation_takes_every_groups_blocks_or_none():
    bm = BlockManager(6, BS, True, windows=[None, 6])
    r = make_request("r", range(20))
    assert not bm.allocate_slots(r, 20)  # 5 blocks in each group: 10 of 6
    assert bm.num_free_blocks == 6 and bm.usage == 0.0
    assert bm.allocate_slots(r, 8) and bm.num_free_blocks == 2 and bm.blocks_needed(8) == 4


def test_blocks_a_windowed_group_gives_back_serve_any_group():
    """Two requests of 36 tokens would hold 18 blocks each with every block kept; in a pool of
    24 both run to the end at once, each holding its 9 full-layer blocks and its window's."""
    sched = make_hybrid_scheduler(window=4, num_blocks=24, budget=8)
    for rid in "ab":
        sched.add_request(make_request(rid, range(10, 30), max_tokens=16))
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.num_preemptions == 0 and sched.block_manager.num_free_blocks == 24


def test_hybrid_prefix_hits_take_the_windowed_blocks_the_next_query_reads():
    sched = make_hybrid_scheduler(window=4)
    prompt = list(range(10, 30))
    a = make_request("a", prompt, max_tokens=1)
    sched.add_request(a)
    while sched.has_unfinished_requests():
        step(sched)
    bm = sched.block_manager
    # the first 12 tokens match: 3 blocks, and the query at 12 reads the window's block 2 only
    hits = bm.get_computed_blocks(make_request("b", prompt[:12] + [99] * 8, max_tokens=1))
    assert [len(h) for h in hits] == [3, 3] and hits[1][:2] == [-1, -1] and hits[1][2] != -1
    sched.add_request(make_request("c", prompt[:12] + [99] * 8, max_tokens=1, arrival=1.0))
    out, _ = step(sched)
    [c] = out.scheduled
    assert c.start_pos == 12 and c.tables()[0][:3] == hits[0] and c.tables()[1][:3] == [0, 0, hits[1][2]]
    while sched.has_unfinished_requests():
        step(sched)
    # a's windowed blocks went back as they left its window, before its full ones, so after
    # the 18 blocks never used they are evicted first: 22 taken leave a's full blocks 0..3
    assert bm.num_free_blocks == 32 and bm.allocate_slots(make_request("x", range(100, 144)), 44)
    assert all((0, h) in bm.pool.cached for h in a.block_hashes[:4]) and (1, a.block_hashes[3]) not in bm.pool.cached
    # so the hit ends where the windowed group still holds its window: 3 blocks, not the full layers' 4
    cached = bm.pool.cached
    assert bm.get_computed_blocks(make_request("d", prompt, max_tokens=1)) == [
        [cached[(0, h)] for h in a.block_hashes[:3]], [-1, -1, cached[(1, a.block_hashes[2])]]]


def test_hybrid_forks_share_both_groups():
    sched = make_hybrid_scheduler(window=4)
    prompt = list(range(10, 30))
    sched.add_request(make_request("p#0", prompt, max_tokens=3), forks=[make_request("p#1", prompt, max_tokens=3)])
    step(sched)
    out, _ = step(sched)  # the child joins at 16: its window (13..16) starts in block 3
    bm = sched.block_manager
    [child] = [s for s in out.scheduled if s.request_id == "p#1"]
    assert child.start_pos == 16 and child.block_table[:4] == bm.block_table("p#0")[:4]
    assert child.tables()[1][:3] == [0] * 3 and child.group_tables[0][3] > 0
    while sched.has_unfinished_requests():
        step(sched)
    assert all(c == 0 for c in bm.pool.ref_cnt)


def test_kv_group_layout():
    from worker.config import EngineConfig, kv_group_layout

    mixed, config = (None, 24, None, 24), EngineConfig()
    assert kv_group_layout(mixed, 4, config) == [(None, (0, 2)), (24, (1, 3))]
    # Gemma 3: five windowed layers in six, in groups as large as the full layers' (the last one smaller)
    gemma3 = tuple(None if i % 6 == 5 else 512 for i in range(14))
    assert kv_group_layout(gemma3, 14, config) == [(None, (5, 11)), (512, (0, 1)), (512, (2, 3)), (512, (4, 6)),
                                                   (512, (7, 8)), (512, (9, 10)), (512, (12, 13))]
    assert kv_group_layout((8, 24), 2, config) == [(24, (0, 1))]  # every layer: the largest window
    assert kv_group_layout((), 3, config) == [(None, (0, 1, 2))]
    assert kv_group_layout(mixed, 4, EngineConfig(disable_hybrid_kv_cache_manager=True)) == [(None, (0, 1, 2, 3))]
    draft = EngineConfig(speculative_config={"model": "draft", "num_speculative_tokens": 2})
    assert kv_group_layout((24, 24), 2, draft) == [(None, (0, 1))]  # the draft's cache holds what the target does
    assert kv_group_layout(mixed, 4, draft) == [(None, (0, 2)), (24, (1, 3))]  # group 0 does


def test_chunks_never_end_inside_a_whole_span():
    """Gemma 3's images (Request.whole_spans): a chunk that would end inside one ends before
    it, the span goes in one later chunk, and a step whose budget cannot hold it schedules
    none of it; each chunk names the spans its tokens fall in."""
    sched = make_scheduler(budget=8)
    a = make_request("a", range(10, 30))  # 20 prompt tokens, an image at [5, 12)
    a.whole_spans = [(5, 12)]
    sched.add_request(a)
    out, _ = step(sched)
    assert [(s.start_pos, len(s.token_ids), s.both_ways) for s in out.scheduled] == [(0, 5, ())]
    out, _ = step(sched)
    assert [(s.start_pos, len(s.token_ids), s.both_ways) for s in out.scheduled] == [(5, 8, ((5, 12),))]
    b = make_request("b", range(40, 50), arrival=1.0)  # its image needs 7 of a step's 8 tokens
    b.whole_spans = [(1, 8)]
    sched.add_request(b)
    out, _ = step(sched)  # a's 7 remaining tokens leave 1: b's first token, not its image
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled] == [("a", 13, 7), ("b", 0, 1)]
    out, _ = step(sched)  # a decodes (1): b's image (7) fits
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled] == [("a", 20, 1), ("b", 1, 7)]
    assert out.scheduled[1].both_ways == ((1, 8),)


def make_state_scheduler(slots=3, interval=8, budget=6, num_blocks=32, host_states=0):
    """A model with linear-attention states: one kept after every `interval` tokens, in `slots`
    (and `host_states` host slots)."""
    bm = BlockManager(num_blocks, BS, True, state_slots=slots, state_interval=interval, num_host_states=host_states)
    return Scheduler(SchedulerConfig(8, budget, 256, "fcfs", frozenset({2})), bm)


def test_steps_save_the_states_at_every_interval_they_pass_once_they_ran():
    """Chunks of 6 tokens over a 20-token prompt pass 8 (mid-chunk) and 16: each step names the
    slots its states go to, and the cache keeps them once the step has run. A prompt sharing 18
    tokens is served up to 16, where a state is kept (its blocks hold 16 more), and its first
    step starts from that state; one sharing 14 gets 8."""
    sched = make_state_scheduler()
    bm = sched.block_manager
    sched.add_request(make_request("a", range(100, 120), max_tokens=1))
    saves = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        saves += [(s.start_pos, s.state_saves) for s in out.scheduled]
        assert not bm.states.cached.keys() & bm.pending_states.keys()
        sched.update_from_output(out, {s.request_id: [7] for s in out.scheduled if s.sample})
    assert saves == [(0, ()), (6, ((8, 2),)), (12, ((16, 1),)), (18, ())]
    assert sorted(bm.states.cached.values()) == [1, 2] and not bm.pending_states
    sched.add_request(make_request("b", [*range(100, 118), 5, 6, 7]))
    sched.add_request(make_request("c", [*range(100, 114), 5, 6, 7]))
    out = sched.schedule()
    assert [(s.request_id, s.start_pos, s.state_restore) for s in out.scheduled] == [("b", 16, 1), ("c", 8, 2)]


def test_unwritten_saves_go_back_and_the_oldest_state_is_evicted():
    """Saves of a request that left the step before it ran (its images failed, or the step
    failed) are never kept: their slots go back. With every slot holding a state, a new one
    takes the least recently used (a hit counts as use); a state kept already is not saved
    again."""
    sched = make_state_scheduler(slots=2, interval=4, budget=64)
    bm = sched.block_manager
    sched.add_request(make_request("a", range(100, 109), max_tokens=1))
    out = sched.schedule()
    assert out.scheduled[0].state_saves == ((4, 1), (8, 0))
    out.scheduled = []  # it never ran
    sched.update_from_output(out, {})
    assert not bm.states.cached and sorted(bm.states.free) == [0, 1]
    sched.abort_requests(["a"])

    def run(rid, prompt):  # its first step
        sched.add_request(make_request(rid, prompt, max_tokens=1))
        first, _ = step(sched)
        while sched.has_unfinished_requests():
            step(sched)
        return first.scheduled[0]

    for rid in ("x1", "x2"):  # the same prompt twice in one step: its state is saved once
        sched.add_request(make_request(rid, range(500, 505), max_tokens=1))
    out, _ = step(sched)
    assert [s.state_saves for s in out.scheduled] == [((4, 0),), ()]
    step(sched)
    for rid, start in (("a", 100), ("b", 200), ("c", 300)):
        run(rid, range(start, start + 5))
    assert len(bm.states.cached) == 2  # x's state and a's made room for b's and c's
    assert run("x3", range(500, 505)).start_pos == 0
    assert run("c2", [*range(300, 305), 1, 2]).start_pos == 4  # x3's state at 4 took b's slot
    run("d", range(400, 405))
    assert run("c3", [*range(300, 305), 9]).start_pos == 4  # c's state, used last, outlived x3's
    assert run("x4", [*range(500, 505), 9]).start_pos == 0  # x3's was evicted: its blocks alone restore nothing


def test_a_state_model_is_refused_odd_intervals():
    with pytest.raises(ValueError, match="multiple of block_size"):
        BlockManager(16, BS, True, state_slots=2, state_interval=6)


def test_evicted_states_go_on_in_host_slots_and_come_back_for_a_hit():
    """One saved slot and one host slot: a second prompt's state evicts the first's to the
    host slot (copied out before the step that overwrites it). A hit on the first's prefix
    takes the saved slot back for it (copied in before the step), the state there giving way;
    the host slot, pinned until then, is not overwritten by that state in the same step (the
    copies out run first), so the copy back reads the first prompt's state."""
    sched = make_state_scheduler(slots=1, interval=4, budget=64, host_states=1)
    bm = sched.block_manager

    def run(rid, prompt):  # its first step's request and swaps
        sched.add_request(make_request(rid, prompt, max_tokens=1))
        first, _ = step(sched)
        while sched.has_unfinished_requests():
            step(sched)
        return first.scheduled[0], first.swaps

    run("a", range(100, 105))  # a's state at 4 in saved slot 0
    _, swaps = run("b", range(200, 205))  # b's takes slot 0: a's goes out to host slot 0
    assert (swaps.states_out, swaps.states_back) == ([(0, 0)], [])
    hit, swaps = run("a2", [*range(100, 105), 7])
    assert (hit.start_pos, hit.state_restore) == (4, 0)
    assert (swaps.states_out, swaps.states_back) == ([], [(0, 0)])  # b's state has no host slot left: dropped
    assert not bm.states.pinned and not bm.host_states.pinned  # (until the step ran)
    assert run("b2", [*range(200, 205), 7])[0].start_pos == 0


def test_a_state_in_the_host_tier_is_a_hit_only_while_a_saved_slot_can_take_it():
    """One saved slot, three host slots holding a's and b's states: a step admitting
    follow-ups of both copies a's back into the saved slot, which it pins until the step has
    run; b's then has no slot to come back into, so b's follow-up computes its prompt (not a
    hit it could not restore)."""
    sched = make_state_scheduler(slots=1, interval=4, budget=64, host_states=3)
    for rid, start in (("a", 100), ("b", 200), ("c", 300)):
        sched.add_request(make_request(rid, range(start, start + 5), max_tokens=1))
        while sched.has_unfinished_requests():
            step(sched)
    assert len(sched.block_manager.host_states.cached) == 2  # a's and b's; c's in the saved slot
    sched.add_request(make_request("a2", [*range(100, 105), 7], max_tokens=1))
    sched.add_request(make_request("b2", [*range(200, 205), 7], max_tokens=1))
    out, _ = step(sched)
    assert [(s.request_id, s.start_pos, s.state_restore) for s in out.scheduled] == [("a2", 4, 0), ("b2", 0, None)]


def test_forks_start_from_their_parents_state_or_from_scratch_if_it_is_gone():
    """A model with states: the parent of n > 1 completions saves its state where its forks
    start (its prompt's full blocks, less the last token's: 8 of 10 tokens), and they start
    from it; a fork whose state was evicted before it ran computes the prompt itself."""
    sched = make_state_scheduler(slots=2, interval=64, budget=64)
    bm = sched.block_manager
    parent, forks = make_request("p", range(100, 110), max_tokens=2), [make_request(f"p#{i}", range(100, 110))
                                                                       for i in (1, 2)]
    sched.add_request(parent, forks=forks)
    out, _ = step(sched)
    [s] = out.scheduled
    assert s.state_saves == ((8, 1),)
    bm.states.take()  # another save takes the free slot; the next evicts the parent's state
    out = sched.schedule()
    assert sorted((s.request_id, s.start_pos, s.state_restore) for s in out.scheduled) == [
        ("p", 10, None), ("p#1", 8, 1), ("p#2", 8, 1)]
    sched.update_from_output(out, {s.request_id: [7] for s in out.scheduled})
    sched.add_request(make_request("q", range(100, 110)), forks=[make_request("q#1", range(100, 110))])
    out, _ = step(sched)  # the same prompt again starts from p's state at 8 too (not saved again)
    assert [(s.request_id, s.start_pos, s.state_restore, s.state_saves) for s in out.scheduled
            if s.request_id == "q"] == [("q", 8, 1, ())]
    assert bm.states.take() == 1  # another save evicts it before q's fork runs
    out = sched.schedule()
    assert sorted((s.request_id, s.start_pos, s.state_restore) for s in out.scheduled if s.request_id[0] == "q") == [
        ("q", 10, None), ("q#1", 0, None)]


def test_a_prefill_budget_caps_prompt_chunks_not_decodes():
    """Step-time-aware chunking's budget (schedule(prefill_budget)): the decodes all run, the
    prompt chunks share the cap in arrival order, and the step counts each kind."""
    sched = make_scheduler(budget=64)
    sched.add_request(make_request("a", range(10, 13)))
    sched.add_request(make_request("b", range(20, 23)))
    step(sched)  # a and b prefilled: they decode from here
    sched.add_request(make_request("c", range(30, 50), arrival=1.0))  # 20 prompt tokens
    sched.add_request(make_request("d", range(50, 60), arrival=2.0))  # 10
    assert sched.num_decode_tokens() == 2
    out = sched.schedule(prefill_budget=8)
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled] == [
        ("a", 3, 1), ("b", 3, 1), ("c", 0, 8)]
    assert (out.num_decode_tokens, out.num_prefill_tokens, out.num_batched_tokens) == (2, 8, 10)
    sched.update_from_output(out, {"a": [7], "b": [7]})
    out = sched.schedule(prefill_budget=15)  # c's next 12 fit, then d's first 3
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled] == [
        ("a", 4, 1), ("b", 4, 1), ("c", 8, 12), ("d", 0, 3)]
    sched.update_from_output(out, {"a": [7], "b": [7], "c": [7]})
    out = sched.schedule(prefill_budget=0)  # no prompt tokens: the decodes still run
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 1), ("b", 1), ("c", 1)]
    assert out.num_prefill_tokens == 0
    sched.update_from_output(out, {"a": [7], "b": [7], "c": [7]})
    out = sched.schedule()  # no cap: d's remaining 7 at once
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled][-1] == ("d", 3, 7)


def test_a_prefill_budget_equal_to_the_token_budget_changes_nothing():
    def chunks(prefill_budget):
        sched = make_scheduler(budget=6)
        sched.add_request(make_request("a", range(10, 13)))
        sched.add_request(make_request("b", range(20, 34), arrival=1.0))
        seen = []
        while sched.has_unfinished_requests():
            out = sched.schedule(prefill_budget)
            seen.append([(s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled])
            sched.update_from_output(out, {s.request_id: [7] for s in out.scheduled if s.sample})
        return seen

    assert chunks(6) == chunks(None)
    assert chunks(2) != chunks(None)


def test_an_image_the_prefill_budget_cannot_hold_goes_whole_past_it():
    """A whole span longer than the prefill budget would wait forever under it: the chunk
    runs to the span's end instead; up to the span, the budget holds."""
    sched = make_scheduler(budget=32)
    a = make_request("a", range(10, 30))  # an image at [3, 13)
    a.whole_spans = [(3, 13)]
    sched.add_request(a)
    out = sched.schedule(prefill_budget=4)  # ends inside the image: cut before it
    assert [(s.start_pos, len(s.token_ids)) for s in out.scheduled] == [(0, 3)]
    sched.update_from_output(out, {})
    out = sched.schedule(prefill_budget=4)  # starts at it: the image whole, past the budget
    assert [(s.start_pos, len(s.token_ids), s.both_ways) for s in out.scheduled] == [(3, 10, ((3, 13),))]
    sched.update_from_output(out, {})
    out = sched.schedule(prefill_budget=4)  # the budget again
    assert [(s.start_pos, len(s.token_ids)) for s in out.scheduled] == [(13, 4)]
