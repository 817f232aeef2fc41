"""Coalesced events (`--stream-interval-ms`): a job's tokens made between two publishes go out
merged into one event per completion, and nothing is delayed that readers wait on.

The workers here hold tokens for a whole minute at any rate (`--stream-coalesce-min-tokens-per-s
0`; by default a worker making fewer than 1000 tokens a second publishes every step), so every job's stream is exactly what the
coalescing rules send at once: a completion's first event (its first step's tokens), then what
a finish, an abort or a drain sends with everything held, merged. Their content must equal what
the offline engine (one event a step, as a worker with no interval sends) produced. The other
queue tests run their workers at the default interval.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from queue_support import WorkerProcess, tokens_sent, wait_for

from producer.client import Client
from producer.jobs import Delta
from producer.protocol import EVENT_FIELD, FINISH_ABORT, JobStatus, Keys, decode_event
from producer.records import decode_worker_info
from producer.sampling_params import SamplingParams

NAME = "qco1"
TIMEOUT_S = 30.0
HOLD_MS = "60000"  # longer than any test here: only the coalescing rules' own sends happen
ANY_RATE = ("--stream-coalesce-min-tokens-per-s", "0")  # (a tiny model's few hundred tokens a second too)


@pytest.fixture(scope="module")
def worker(spawn: Callable[..., WorkerProcess], conn: redis.Redis) -> WorkerProcess:
    proc = spawn(NAME, via="genq", args=("--stream-interval-ms", HOLD_MS, *ANY_RATE, "--max-num-seqs", "8"))
    proc.wait_ready(conn)
    return proc


def generated(conn: redis.Redis, keys: Keys, name: str) -> int:
    """Tokens the worker says (in its heartbeat) it has generated so far."""
    fields = conn.hgetall(keys.worker(name))
    return decode_worker_info(fields, name).generation_tokens_total if fields else 0


def generated_when_idle(conn: redis.Redis, keys: Keys, name: str) -> int:
    """generated() from a heartbeat that shows no job running or waiting: every token of the
    jobs before is counted in it (a beat taken mid-job would count them later)."""
    def idle() -> int | None:
        info = decode_worker_info(conn.hgetall(keys.worker(name)), name)
        return info.generation_tokens_total + 1 if (info.running, info.waiting) == (0, 0) else None

    return wait_for(idle, TIMEOUT_S, f"an idle beat of {name}") - 1


def by_index(deltas: list[Delta], index: int) -> list[Delta]:
    return [d for d in deltas if d.index == index]


def test_a_coalesced_stream_sends_the_first_step_at_once_then_the_rest_merged_at_the_finish(
    client: Client, offline
) -> None:
    cases = [
        ("The capital of France is", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)),
        ("Once upon a time", SamplingParams(temperature=0.0, max_tokens=16, n=2, ignore_eos=True)),
        ("Roses are red", SamplingParams(temperature=0.8, seed=7, max_tokens=20)),
    ]
    handles = [client.submit(prompt, params) for prompt, params in cases]
    for handle, (prompt, params) in zip(handles, cases, strict=True):
        result = handle.result(TIMEOUT_S)  # well within the interval: the final event was not held
        assert result.status == JobStatus.FINISHED
        deltas = list(handle.stream(TIMEOUT_S))
        for want in offline(prompt, params):
            mine = by_index(deltas, want.index)
            assert len(mine) < len(want.token_ids)  # coalesced
            assert mine[0].token_ids == want.token_ids[:1] and mine[0].seq == 0  # the first step, alone
            assert mine[-1].finished and mine[-1].finish_reason == want.finish_reason
            assert [t for d in mine for t in d.token_ids] == want.token_ids
            assert "".join(d.text for d in mine) == want.text
            if params.logprobs is not None:
                got = [lp for d in mine for lp in d.logprobs or []]
                assert len(got) == len(want.token_ids)
                assert [lp["logprob"] for lp in got] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)


def test_a_stop_string_ends_a_coalesced_stream_with_the_text_cut_as_one_event_a_step_cuts_it(
    client: Client, offline
) -> None:
    free = offline("The meaning of life", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2:][:3]  # a piece of the greedy text, mid-way
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    want = offline("The meaning of life", params)[0]
    assert want.finish_reason == "stop"
    deltas = list(client.stream(client.submit("The meaning of life", params).id, TIMEOUT_S))
    assert "".join(d.text for d in deltas) == want.text
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop


def test_a_cancel_mid_run_sends_the_held_tokens_with_the_abort(client: Client, conn: redis.Redis) -> None:
    before = generated_when_idle(conn, client.keys, NAME)
    handle = client.submit("Hold these", SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True))
    events = client.keys.events(handle.id)
    wait_for(lambda: generated(conn, client.keys, NAME) >= before + 20, TIMEOUT_S, "tokens made and held")
    assert conn.xlen(events) == 1  # the first step's event; the rest is held
    handle.cancel()
    result = handle.result(TIMEOUT_S)
    deltas = list(handle.stream(TIMEOUT_S))
    assert result.status == JobStatus.CANCELLED and len(result.token_ids) >= 20
    assert len(deltas) == 2 and deltas[-1].finish_reason == FINISH_ABORT
    assert [t for d in deltas for t in d.token_ids] == result.token_ids


def test_a_drain_sends_the_held_tokens_before_it_releases_the_job(
    spawn: Callable[..., WorkerProcess], conn: redis.Redis, worker: WorkerProcess,
    client: Client, offline,
) -> None:
    """What the worker that resumes a released job goes on from is its stream: the drain's
    last write holds every token made, equal to plain decoding's start (reclaiming itself is
    test_queue_worker's and test_queue_failover's)."""
    worker.terminate()  # one worker at a time: the job must run on the one that drains
    worker.wait(TIMEOUT_S)
    draining = spawn("qco2", via="genq", args=("--stream-interval-ms", HOLD_MS, *ANY_RATE, "--shutdown-grace-s", "0"))
    draining.wait_ready(conn)
    handle = client.submit("Drain me", SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True))
    wait_for(lambda: generated(conn, client.keys, "qco2") >= 20, TIMEOUT_S, "tokens made and held")
    draining.terminate()
    assert draining.wait(TIMEOUT_S) == 0
    handle.cancel()  # (released, it would run on the next test's worker)
    sent = [decode_event(e[EVENT_FIELD.encode()]) for _, e in conn.xrange(client.keys.events(handle.id))]
    assert len(sent) == 2 and len(sent[1].token_ids) >= 19  # the first step's event, then the drain's
    tokens = [t for e in sent for t in e.token_ids]
    plain = offline("Drain me", SamplingParams(temperature=0.0, max_tokens=len(tokens), ignore_eos=True))[0]
    # (a drain that cuts a character's bytes holds them back, as any unfinished step does: they
    # go out with the token that ends the character; the offline run, finished there, spells
    # them U+FFFD)
    assert tokens == plain.token_ids and "".join(e.text for e in sent) == plain.text.rstrip("\ufffd")


def test_tokens_held_when_no_step_comes_go_out_after_the_interval(
    spawn: Callable[..., WorkerProcess], conn: redis.Redis, worker: WorkerProcess, client: Client,
) -> None:
    """A pause in mode keep freezes the job: no step comes to carry its held tokens, so the
    publisher's timer sends them once the interval has passed (a cancel then ends it)."""
    worker.stop()  # (if the drain's test has not): the job must run on this test's worker
    spawn("qco3", via="genq", args=("--stream-interval-ms", "500", *ANY_RATE)).wait_ready(conn)
    keys = client.keys
    pause = keys.pause(decode_worker_info(conn.hgetall(keys.worker("qco3")), "qco3").model)
    handle = client.submit("Freeze me", SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True))
    wait_for(lambda: generated(conn, keys, "qco3") >= 20, TIMEOUT_S, "tokens made")
    conn.hset(pause, mapping={"paused": 1, "mode": "keep"})
    conn.hincrby(pause, "count", 1)
    # (and it beats at once, as `genq pause` has it: at its next heartbeat, the tiny model
    # could have made all 900 tokens, and the job would have ended before the pause)
    conn.publish(keys.control_channel, pause)
    try:
        info = wait_for(lambda: (i := decode_worker_info(conn.hgetall(keys.worker("qco3")), "qco3")).paused and i,
                        TIMEOUT_S, "the worker paused")
        made = generated(conn, keys, "qco3")  # frozen: it makes no more
        assert info.running == 1
        wait_for(lambda: tokens_sent(conn, keys, handle.id) == made, TIMEOUT_S, "the held tokens sent")
        handle.cancel()
        result = handle.result(TIMEOUT_S)
    finally:
        conn.hset(pause, "paused", 0)
        conn.hincrby(pause, "count", 1)
    assert result.status == JobStatus.CANCELLED and len(result.token_ids) == made
    assert [t for d in handle.stream(TIMEOUT_S) for t in d.token_ids] == result.token_ids
