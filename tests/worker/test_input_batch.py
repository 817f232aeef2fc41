"""The persistent batch (worker.model_executor.input_batch) against tables read whole: long
random runs of a real scheduler and block manager (requests added, aborted, preempted,
finished; blocks added, prefix hits, n > 1 forks, a windowed group giving blocks back), and at
every step the attention inputs built from the persistent batch's rows equal those built from
each request's tables read whole, as the runner built them before it kept rows."""

from __future__ import annotations

import random

import pytest
import torch

from producer.sampling_params import SamplingParams
from worker.config import SchedulerConfig
from worker.core.block_manager import BlockManager
from worker.core.request import Request
from worker.core.scheduler import Scheduler, SchedulerOutput
from worker.model_executor.attention import DecodeBucket, PrefillChunk, TorchAttention, pad_tables
from worker.model_executor.input_batch import InputBatch
from worker.model_executor.model_runner import _order_decodes_first

BS = 4
WINDOW = 9


def make_engine_parts(seed: int, windows: list[int | None]) -> tuple[Scheduler, random.Random]:
    # few blocks for many requests: preemptions come often
    bm = BlockManager(48, BS, True, windows=windows)
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=40, max_model_len=96, policy="fcfs",
                          eos_token_ids=frozenset({2}))
    return Scheduler(cfg, bm), random.Random(seed)


def add_random(sched: Scheduler, rng: random.Random, i: int) -> None:
    shared = [5, 6, 7, 8, 9, 10, 11, 12]  # a common prefix: prefix-cache hits
    prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 30))]
    max_tokens = rng.randrange(1, 40)
    n = 3 if rng.random() < 0.15 else 1

    def make(rid: str) -> Request:
        request = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, n=n), arrival_time=float(i))
        request.max_tokens = max_tokens
        return request

    if n == 1:
        sched.add_request(make(str(i)))
    else:
        sched.add_request(make(f"{i}#0"), forks=[make(f"{i}#{k}") for k in range(1, n)])


def metadata(attention: TorchAttention, batch, tables: torch.Tensor, spans) -> list[tuple]:
    """What attention reads of a step's tables: each bucket's block rows and masks, each chunk's
    context rows and masks."""
    meta = attention.build(batch, tables, torch.zeros(sum(len(s.token_ids) for s in batch), dtype=torch.long), spans)
    parts: list[tuple] = []
    for part in [*meta.decodes, *meta.prefills]:
        rows = part.block_rows if isinstance(part, DecodeBucket) else part.context_rows
        assert isinstance(part, DecodeBucket | PrefillChunk)
        parts.append((None if rows is None else rows.tolist(), {k: m.tolist() for k, m in part.masks.items()}))
    return parts


def check_step(out: SchedulerOutput, batch_rows: InputBatch, attention: TorchAttention,
               spans_of_group: list[frozenset]) -> None:
    batch = _order_decodes_first(out.scheduled)
    rows = batch_rows.update(out, batch)
    if not batch:
        return
    width = -(-max(s.start_pos + len(s.token_ids) for s in batch) // BS)
    whole = [s.tables() for s in batch]
    for group, spans in enumerate(spans_of_group):
        kept = batch_rows.tables(group, rows, width)
        read = pad_tables([t[group][:width] for t in whole], torch.device("cpu"), width)
        if spans == frozenset({None}):  # a full group's tables are the same entry for entry
            assert torch.equal(kept, read)
        assert metadata(attention, batch, kept, spans) == metadata(attention, batch, read, spans)


@pytest.mark.parametrize("windows", [[None], [None, WINDOW]], ids=["full", "full+windowed"])
@pytest.mark.parametrize("seed", range(3))
def test_persistent_rows_give_the_inputs_of_tables_read_whole(seed: int, windows: list[int | None]) -> None:
    sched, rng = make_engine_parts(seed, windows)
    batch_rows = InputBatch(len(windows), max_rows=2, max_blocks=4)  # (both grow as needed)
    attention = TorchAttention(BS, 4, 2, 8, torch.float32, torch.device("cpu"))
    spans_of_group = [frozenset({window}) for window in windows]
    added = steps = preempted = 0
    while steps < 300:
        if rng.random() < 0.3 and added < 120:
            add_random(sched, rng, added)
            added += 1
        if rng.random() < 0.05 and sched.running:  # an abort mid-run
            sched.abort_requests([rng.choice(sched.running).request_id])
        out = sched.schedule()
        preempted += len(out.preempted)
        check_step(out, batch_rows, attention, spans_of_group)
        sampled = {s.request_id: [rng.randrange(3, 50)] for s in out.scheduled if s.sample}
        sched.update_from_output(out, sampled)
        sched.finished.clear()
        steps += 1
    assert preempted > 0 and added > 50  # (the run went through what it is meant to)
    for request_id in list(sched.requests):  # all end: every row is freed
        sched.abort_requests([request_id])
    batch_rows.update(sched.schedule(), [])
    assert len(batch_rows) == 0 and not batch_rows.block_tables.any()


def test_a_step_the_runner_never_ran_leaves_its_rows_whole() -> None:
    """A step scheduled but never given to the batch (it failed before the runner read it):
    the next step brings the row every block its tables gained since the row last saw them."""
    sched, _ = make_engine_parts(0, [None])
    batch_rows = InputBatch(1, max_rows=4, max_blocks=8)
    attention = TorchAttention(BS, 4, 2, 8, torch.float32, torch.device("cpu"))
    request = Request("a", list(range(3, 10)), SamplingParams(max_tokens=20))
    request.max_tokens = 20
    sched.add_request(request)
    for lost in (False, False, True, True, False, False):  # the lost steps add a block
        out = sched.schedule()
        if not lost:
            check_step(out, batch_rows, attention, [frozenset({None})])
        sched.update_from_output(out, {"a": [11]})
    row = batch_rows.row_of["a"]
    assert batch_rows.block_tables[0, row, : len(sched.block_manager.block_table("a"))].tolist() == \
        sched.block_manager.block_table("a")
