"""One worker (`genq worker`, a subprocess on the tiny model) serving jobs through Redis:
results and streams match the offline engine, and bad input fails only its own job."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

import msgpack
import pytest
import redis
from queue_support import (
    WorkerProcess,
    age,
    ended,
    ghost_takes,
    record,
    streamed_pieces,
    tokens_sent,
    wait_for,
)

from producer.async_client import AsyncClient
from producer.client import Client
from producer.dead_letters import list_dead, retry_dead
from producer.jobs import JobFailed, build_job
from producer.pooling_params import PoolingParams
from producer.protocol import (
    DEFAULT_EVENTS_RETENTION_S,
    ERROR_INVALID_REQUEST,
    EVENT_FIELD,
    FINISH_ABORT,
    JobStatus,
    Keys,
    decode_event,
    encode_job,
)
from producer.records import decode_dead_letter, decode_worker_info, encode_dead_letter
from producer.redis_server import RedisServer, free_port
from producer.sampling_params import SamplingParams

NAME = "qw1"
SERVED = "tiny-served"
TIMEOUT_S = 30.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
MAX_ENTRY_BYTES = 1 << 20  # the module's worker's --max-entry-bytes


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(spawn: Callable[..., WorkerProcess], conn: redis.Redis, metrics_port: int) -> WorkerProcess:
    args = ("--served-model-name", SERVED, "--max-num-seqs", "8", "--max-entry-bytes", str(MAX_ENTRY_BYTES),
            "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1")
    proc = spawn(NAME, via="genq", args=args)
    proc.wait_ready(conn)
    return proc


def dead_letters(conn: redis.Redis, keys: Keys) -> dict[str, dict]:
    """Dead letters by the entry id they replace."""
    letters = (decode_dead_letter(fields) for _, fields in conn.xrange(keys.dead))
    return {letter["entry_id"]: letter for letter in letters}


def stored_tokens(conn: redis.Redis, keys: Keys, job_id: str) -> list[int]:
    """The tokens of a job's events stream, in order, checking that no event is there twice
    (a second run would repeat seqs: coalescing merges steps, it never repeats one)."""
    events = [decode_event(fields[EVENT_FIELD.encode()]) for _, fields in conn.xrange(keys.events(job_id))]
    assert [e.seq for e in events] == list(range(len(events)))
    return [t for e in events for t in e.token_ids]


def test_results_and_streams_match_the_offline_engine(client: Client, offline) -> None:
    chat = [{"role": "user", "content": "What is two plus two?"}]
    cases = [
        ("The capital of France is", GREEDY),
        ({"prompt_token_ids": [1, 450, 7483, 310, 3444]}, GREEDY),
        (chat, GREEDY),
        ("Once upon a time", SamplingParams(temperature=0.0, max_tokens=8, n=2)),
        ("Roses are red", SamplingParams(temperature=0.8, seed=123, max_tokens=12)),
    ]
    handles = [client.submit(prompt, params) for prompt, params in cases]
    for handle, (prompt, params) in zip(handles, cases, strict=True):
        result = handle.result(TIMEOUT_S)
        expected = offline(prompt, params)
        assert result.status == JobStatus.FINISHED
        assert [(o.text, o.token_ids, o.finish_reason) for o in result.outputs] == [
            (o.text, o.token_ids, o.finish_reason) for o in expected
        ]
        deltas = list(handle.stream(TIMEOUT_S))
        for output in result.outputs:
            mine = [d for d in deltas if d.index == output.index]
            assert "".join(d.text for d in mine) == output.text
            assert [t for d in mine for t in d.token_ids] == output.token_ids
            assert [d.seq for d in mine] == list(range(len(mine)))
        assert result.usage is not None
        assert result.usage["completion_tokens"] == sum(len(o.token_ids) for o in result.outputs)


def test_prompt_logprobs_come_once_on_the_first_delta(client: Client, offline, tiny_llama_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=4, n=2, prompt_logprobs=3)
    for prompt in ("The capital of France is", {"prompt_token_ids": [1, 450, 7483, 310, 3444]}):
        expected = offline(prompt, params, whole=True)
        deltas = list(client.stream(client.submit(prompt, params).id, TIMEOUT_S))
        carrying = [d for d in deltas if d.prompt_logprobs is not None]
        assert [(d.index, d.seq) for d in carrying] == [(0, 0)]
        wire = carrying[0].prompt_logprobs
        ids = expected.prompt_token_ids
        assert len(wire) == len(ids)
        assert wire[0] == {"token_id": ids[0], "token": tokenizer.decode(ids[:1])}
        assert [e["token_id"] for e in wire] == ids
        for got, want in zip(wire[1:], expected.prompt_logprobs[1:], strict=True):
            assert got["logprob"] == pytest.approx(want.logprob, abs=1e-5)
            assert got["rank"] == want.rank and got["token"] == want.decoded[want.token_id]
            assert got["top_logprobs"] == pytest.approx(want.top_logprobs, abs=1e-5)
        assert carrying[0].prompt == expected.prompt
        assert expected.prompt.startswith("The capital" if isinstance(prompt, str) else "<|im_start|>")


def test_late_subscriber_receives_every_token(
    client: Client, conn: redis.Redis, offline
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    handle = client.submit("A late reader", params)
    wait_for(lambda: tokens_sent(conn, client.keys, handle.id) >= 5, TIMEOUT_S, "first tokens")
    late = list(handle.stream(TIMEOUT_S))  # subscribes mid-job (or after it)
    result = handle.result(TIMEOUT_S)
    after = list(handle.stream(TIMEOUT_S))  # subscribes after the end: replay only
    expected = offline("A late reader", params)[0]
    for deltas in (late, after):
        assert [t for d in deltas for t in d.token_ids] == result.token_ids == expected.token_ids
        assert "".join(d.text for d in deltas) == result.text == expected.text
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"


def test_a_reader_after_the_events_expired_gets_the_whole_result_from_the_record(
    client: Client, conn: redis.Redis, redis_server: RedisServer
) -> None:
    """The worker cuts an ended job's events to GENQ_EVENTS_RETENTION_S (the record lives a
    day); once they are gone, stream(), result(), the async client and inspect still give
    every completion's text and token ids, the same as the events did."""
    handle = client.submit("Bounded events", SamplingParams(temperature=0.0, max_tokens=12, n=2))
    result = handle.result(TIMEOUT_S)
    before = list(handle.stream(TIMEOUT_S))
    assert 0 < conn.ttl(client.keys.events(handle.id)) <= DEFAULT_EVENTS_RETENTION_S
    assert conn.ttl(client.keys.job(handle.id)) > DEFAULT_EVENTS_RETENTION_S
    conn.delete(client.keys.events(handle.id))  # as the retention ends it
    late = list(handle.stream(TIMEOUT_S))

    async def async_late() -> list:
        async with AsyncClient(redis_server.url, prefix=client.keys.prefix) as aclient:
            return [d async for d in aclient.stream(handle.id, TIMEOUT_S)]

    for deltas in (before, late, asyncio.run(async_late())):
        for output in result.outputs:
            mine = [d for d in deltas if d.index == output.index]
            assert "".join(d.text for d in mine) == output.text
            assert [t for d in mine for t in d.token_ids] == output.token_ids
            assert mine[-1].finished and mine[-1].finish_reason == output.finish_reason == "length"
    assert [(d.index, d.seq) for d in late] == [(0, 0), (1, 0)] and late[0].usage == result.usage
    again = handle.result(TIMEOUT_S)
    assert [(o.text, o.token_ids) for o in again.outputs] == [(o.text, o.token_ids) for o in result.outputs]
    view = client.inspect(handle.id)
    assert view["events"] == [] and [o["token_ids"] for o in view["record"]["outputs"]] == [
        o.token_ids for o in result.outputs]


def test_cancel_mid_stream_aborts_the_job(client: Client, conn: redis.Redis) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    handle = client.submit("Cancel me", params)
    deltas = []
    for delta in handle.stream(TIMEOUT_S):
        if not deltas:
            handle.cancel()
        deltas.append(delta)
    assert deltas[-1].finished and deltas[-1].finish_reason == FINISH_ABORT
    result = handle.result(TIMEOUT_S)
    assert result.status == JobStatus.CANCELLED
    assert 0 < len(result.token_ids) < 1000
    assert result.token_ids == [t for d in deltas for t in d.token_ids]
    assert record(conn, client.keys, handle.id).extra["abort_reason"] == "cancelled"


def test_cancel_before_intake_never_runs(client: Client, conn: redis.Redis) -> None:
    client.cancel("cancelled-early")  # the durable flag, set before the job even exists
    handle = client.submit("never runs", GREEDY, job_id="cancelled-early")
    result = handle.result(TIMEOUT_S)
    assert (result.status, result.token_ids, result.finish_reason) == (JobStatus.CANCELLED, [], FINISH_ABORT)
    assert conn.xpending(client.keys.requests, client.keys.group)["pending"] == 0


def test_expired_deadline_aborts_without_running(client: Client, conn: redis.Redis) -> None:
    job = build_job("too late", GREEDY, job_id="expired-1")
    job.deadline = time.time() - 1.0  # as a producer whose job waited too long would find
    conn.xadd(client.keys.requests, encode_job(job))  # a non-Python producer: no record yet
    wait_for(lambda: ended(conn, client.keys, "expired-1"), TIMEOUT_S, "job ended")
    result = client.result("expired-1", TIMEOUT_S)
    assert (result.status, result.token_ids, result.finish_reason) == (JobStatus.CANCELLED, [], FINISH_ABORT)
    rec = record(conn, client.keys, "expired-1")
    assert rec.extra["abort_reason"] == "deadline" and rec.worker == NAME


def test_deadline_passing_mid_run_aborts_the_job(client: Client, conn: redis.Redis) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    handle = client.submit("Run out of time", params, deadline_s=0.2)
    deltas = list(handle.stream(TIMEOUT_S))
    result = handle.result(TIMEOUT_S)
    assert (result.status, result.finish_reason) == (JobStatus.CANCELLED, FINISH_ABORT)
    assert len(result.token_ids) < 1000
    assert [t for d in deltas for t in d.token_ids] == result.token_ids
    assert record(conn, client.keys, handle.id).extra["abort_reason"] == "deadline"


def test_garbage_entries_go_to_dead_while_good_jobs_finish(
    client: Client, conn: redis.Redis
) -> None:
    keys = client.keys
    garbage = conn.xadd(keys.requests, {"foo": "bar"}).decode()  # redis-cli XADD ... foo bar
    bad_payload = conn.xadd(keys.requests, {"id": "bad-payload", "payload": b"\xc1"}).decode()
    good = [client.submit(f"good job {i}", GREEDY) for i in range(3)]
    for handle in good:
        assert handle.result(TIMEOUT_S).status == JobStatus.FINISHED
    letters = wait_for(
        lambda: (d := dead_letters(conn, keys)) and garbage in d and bad_payload in d and d,
        TIMEOUT_S, "dead letters",
    )
    assert "no 'id' field" in letters[garbage]["reason"]
    assert letters[garbage]["entry"] == {"foo": b"bar"}
    assert "msgpack" in letters[bad_payload]["reason"]
    with pytest.raises(JobFailed, match="msgpack"):
        client.result("bad-payload", TIMEOUT_S)
    assert conn.xpending(keys.requests, keys.group)["pending"] == 0


def test_an_oversize_entry_is_dead_lettered_without_its_payload_and_deleted(
    client: Client, conn: redis.Redis
) -> None:
    """An entry over max_entry_bytes (a 10 MB one by redis-cli, a job past the API) is stored
    once, never twice: its dead letter keeps its size and why, not its payload; the entry leaves
    the requests stream; a job it names fails with that reason; the next job runs."""
    keys = client.keys
    garbage = conn.xadd(keys.requests, {"id": "huge", "payload": b"\x00" * (10 << 20)}).decode()
    job = build_job("A" * (MAX_ENTRY_BYTES + 10), GREEDY, job_id="huge-prompt")  # a real job, too large
    entry = conn.xadd(keys.requests, encode_job(job)).decode()
    letters = wait_for(lambda: (d := dead_letters(conn, keys)) and garbage in d and entry in d and d, TIMEOUT_S,
                       "dead letters")
    with pytest.raises(JobFailed, match=rf"bytes, over this worker's limit of {MAX_ENTRY_BYTES}") as failure:
        client.result("huge-prompt", TIMEOUT_S)
    assert failure.value.error_type == ERROR_INVALID_REQUEST
    assert letters[garbage]["entry"] == {} and letters[garbage]["entry_bytes"] == 10 * 2**20 + len("idhugepayload")
    assert letters[garbage]["reason"].startswith(f"the entry is {letters[garbage]['entry_bytes']} bytes")
    assert letters[entry]["id"] == "huge-prompt" and letters[entry]["entry_bytes"] > MAX_ENTRY_BYTES
    assert conn.xrange(keys.requests, garbage, garbage) == conn.xrange(keys.requests, entry, entry) == []
    assert max(len(f[b"entry"]) for _, f in conn.xrange(keys.dead)) < 1000  # no payload was copied
    assert client.submit("after them", GREEDY).result(TIMEOUT_S).status == JobStatus.FINISHED


def test_a_large_undecodable_entry_is_not_kept_twice(client: Client, conn: redis.Redis) -> None:
    """Under max_entry_bytes but undecodable (a malformed entry of redis-cli's): no retry can
    run it, so beyond a readable size its dead letter keeps its size and why, not its bytes,
    and the entry leaves the requests stream. A small one is kept whole, to be read."""
    keys = client.keys
    large = conn.xadd(keys.requests, {"id": "large-garbage", "payload": b"\xc1" * (256 << 10)}).decode()
    small = conn.xadd(keys.requests, {"id": "small-garbage", "payload": b"\xc1" * 16}).decode()
    letters = wait_for(lambda: (d := dead_letters(conn, keys)) and large in d and small in d and d, TIMEOUT_S,
                       "dead letters")
    assert letters[large]["entry"] == {} and letters[large]["entry_bytes"] == (256 << 10) + len("idlarge-garbagepayload")
    assert letters[large]["reason"].startswith(f"cannot decode the entry ({letters[large]['entry_bytes']} bytes")
    assert conn.xrange(keys.requests, large, large) == []
    assert letters[small]["entry"]["payload"] and letters[small]["entry_bytes"] is None
    with pytest.raises(JobFailed, match="cannot decode the entry"):
        client.result("large-garbage", TIMEOUT_S)


def test_invalid_sampling_params_from_another_producer_fail_the_job(
    client: Client, conn: redis.Redis
) -> None:
    entry = encode_job(build_job("hi", GREEDY, job_id="bad-params"))
    payload = msgpack.unpackb(entry["payload"])
    payload["sampling_params"]["temperature"] = -1.0
    entry["payload"] = msgpack.packb(payload)
    entry_id = conn.xadd(client.keys.requests, entry).decode()
    wait_for(lambda: ended(conn, client.keys, "bad-params"), TIMEOUT_S, "job failed")
    with pytest.raises(JobFailed, match="temperature must be") as failure:
        client.result("bad-params", TIMEOUT_S)
    assert failure.value.error_type == ERROR_INVALID_REQUEST  # the job's fault: do not retry
    assert "temperature" in dead_letters(conn, client.keys)[entry_id]["reason"]


def test_prompt_over_max_model_len_fails_its_job(client: Client, conn: redis.Redis) -> None:
    handle = client.submit({"prompt_token_ids": [5] * 1100}, GREEDY)
    neighbour = client.submit("still served", GREEDY)
    with pytest.raises(JobFailed, match="max_model_len is 1024") as failure:
        handle.result(TIMEOUT_S)
    with pytest.raises(JobFailed, match="max_model_len") as streamed:
        list(handle.stream(TIMEOUT_S))  # the stream ends with the error event
    assert failure.value.error_type == streamed.value.error_type == ERROR_INVALID_REQUEST
    assert neighbour.result(TIMEOUT_S).status == JobStatus.FINISHED
    entry_id = record(conn, client.keys, handle.id).entry_id
    assert dead_letters(conn, client.keys)[entry_id]["reason"] == failure.value.error


def test_max_tokens_past_max_model_len_fails_its_job_naming_both(client: Client, conn: redis.Redis) -> None:
    """A job submitted around the API (Python client, redis-cli) meets vLLM's rule in the worker:
    prompt plus max_tokens past max_model_len fails it at once, never a clamped 1,000-token run."""
    handle = client.submit({"prompt_token_ids": [5] * 24}, SamplingParams(max_tokens=10**9))
    with pytest.raises(JobFailed, match=r"maximum context length is 1024 tokens\. However, you requested "
                                        r"1000000024 tokens \(24 in the prompt, 1000000000 in the completion\)") as failure:
        handle.result(TIMEOUT_S)
    assert failure.value.error_type == ERROR_INVALID_REQUEST
    assert not record(conn, client.keys, handle.id).completion_tokens


def test_model_names(client: Client, conn: redis.Redis) -> None:
    served = client.submit("by name", GREEDY, model=SERVED)
    assert served.result(TIMEOUT_S).status == JobStatus.FINISHED
    unknown = client.submit("by a wrong name", GREEDY, model="gpt-17")
    with pytest.raises(JobFailed, match="model 'gpt-17' is not served"):
        unknown.result(TIMEOUT_S)
    entry_id = record(conn, client.keys, unknown.id).entry_id
    assert "gpt-17" in dead_letters(conn, client.keys)[entry_id]["reason"]


def test_duplicate_job_id_runs_once(client: Client, conn: redis.Redis) -> None:
    first = client.submit("once", GREEDY, job_id="dup-1")
    again = client.submit("once", GREEDY, job_id="dup-1")
    assert (first.enqueued, again.enqueued) == (True, False)
    result = first.result(TIMEOUT_S)
    entry_id = record(conn, client.keys, "dup-1").entry_id
    [(_, fields)] = conn.xrange(client.keys.requests, entry_id, entry_id)
    copy = conn.xadd(client.keys.requests, fields).decode()  # a producer that XADDs twice
    letter = wait_for(lambda: dead_letters(conn, client.keys).get(copy), TIMEOUT_S, "dead copy")
    assert "duplicate" in letter["reason"] and letter["id"] == "dup-1"
    assert stored_tokens(conn, client.keys, "dup-1") == result.token_ids  # each token once
    assert len(result.token_ids) == GREEDY.max_tokens
    assert client.result("dup-1").token_ids == result.token_ids


def test_two_entries_of_one_job_in_one_read_run_once(client: Client, conn: redis.Redis) -> None:
    fields = encode_job(build_job("twice", GREEDY, job_id="dup-2"))
    pipe = conn.pipeline(transaction=True)  # both land before the worker's next read
    pipe.xadd(client.keys.requests, fields)
    pipe.xadd(client.keys.requests, fields)
    first, second = (e.decode() for e in pipe.execute())
    wait_for(lambda: ended(conn, client.keys, "dup-2"), TIMEOUT_S, "job ended")
    result = client.result("dup-2", TIMEOUT_S)
    assert result.status == JobStatus.FINISHED and len(result.token_ids) == GREEDY.max_tokens
    ran = record(conn, client.keys, "dup-2").entry_id
    other = second if ran == first else first
    letter = wait_for(lambda: dead_letters(conn, client.keys).get(other), TIMEOUT_S, "dead copy")
    assert "duplicate" in letter["reason"]
    assert stored_tokens(conn, client.keys, "dup-2") == result.token_ids


def test_heartbeat_reports_model_capacity_and_load(
    client: Client, conn: redis.Redis, worker: WorkerProcess
) -> None:
    client.submit("count me", GREEDY).result(TIMEOUT_S)

    def idle_beat():
        info = decode_worker_info(conn.hgetall(client.keys.worker(NAME)), NAME)
        idle = (info.running, info.waiting, info.free_slots) == (0, 0, 8)
        return info if idle and info.requests_finished_total > 0 else None

    info = wait_for(idle_beat, TIMEOUT_S, "a heartbeat after the work")
    assert (info.model, info.max_num_seqs, info.pid, info.state) == (SERVED, 8, worker.pid, "serving")
    assert info.max_model_len == 1024  # the tiny model's max_position_embeddings
    assert info.generation_tokens_total > 0 and info.prompt_tokens_total > 0
    ttl = conn.ttl(client.keys.worker(NAME))
    assert 0 < ttl <= 30


def test_metrics_endpoint(client: Client, metrics_port: int) -> None:
    """Every metric, and the prefix cache's: the same long prompt twice, the second time
    mostly from the cache."""
    for _ in range(2):
        client.submit("measure me " * 20, GREEDY).result(TIMEOUT_S)

    def scrape() -> tuple[str, dict[str, float]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=TIMEOUT_S) as response:
            text = response.read().decode()
        return text, {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith("genq:prefix")}

    deadline = time.monotonic() + TIMEOUT_S  # the stats of the job's last step may follow its result
    text, values = scrape()
    while values["genq:prefix_cache_hits_total"] < 32 and time.monotonic() < deadline:
        time.sleep(0.05)
        text, values = scrape()
    for name in (
        "genq:num_requests_running", "genq:num_requests_waiting", "genq:kv_cache_usage_perc",
        "genq:generation_tokens_total", "genq:prompt_tokens_total",
        "genq:time_to_first_token_seconds_bucket", "genq:inter_token_latency_seconds_bucket",
        "genq:e2e_request_latency_seconds_count",
    ):
        assert name in text, name
    assert f'model_name="{SERVED}"' in text
    assert values["genq:prefix_cache_queries_total"] >= values["genq:prefix_cache_hits_total"] >= 32
    assert values["genq:prefix_cache_host_hits_total"] == 0  # no offloading


def test_arq_health_check(worker: WorkerProcess) -> None:
    def check(name: str) -> int:
        env = {**worker.env, "GENQ_WORKER_NAME": name}
        argv = [sys.executable, "-m", "arq", "--check", "worker.WorkerSettings"]
        return subprocess.run(argv, env=env, capture_output=True, timeout=TIMEOUT_S).returncode

    assert check(NAME) == 0
    assert check("no-such-worker") == 1


# ---------------------------------------------------------------------------------------------
# Reclaiming: entries left pending by a worker that is gone ("ghost"), staged by hand


def test_reclaimed_job_resumes_from_its_events(
    client: Client, conn: redis.Redis, offline, tiny_llama_dir
) -> None:
    from transformers import AutoTokenizer

    from producer.protocol import APPEND_EVENTS_LUA, EVENTS_TTL_S, Event, encode_event

    params = SamplingParams(temperature=0.0, max_tokens=12, n=2, prompt_logprobs=1)
    expected = offline("Resume me", params)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    keys = client.keys
    entry_id = ghost_takes(conn, keys, encode_job(build_job("Resume me", params, job_id="resume-1")))
    append = conn.register_script(APPEND_EVENTS_LUA)
    sent = {0: 5, 1: 3}  # the ghost had streamed 5 tokens of completion 0 and 3 of completion 1
    for index, count in sent.items():
        ids = expected[index].token_ids[:count]
        events = [
            encode_event(Event(seq=i, token_ids=[t], text=piece, index=index))
            for i, (t, piece) in enumerate(zip(ids, streamed_pieces(tokenizer, params, ids), strict=True))
        ]
        append(keys=[keys.events("resume-1")], args=[EVENTS_TTL_S, *events])
    age(conn, keys, entry_id)
    wait_for(lambda: ended(conn, keys, "resume-1"), TIMEOUT_S, "resumed job ended")
    result = client.result("resume-1", TIMEOUT_S)
    assert [(o.text, o.token_ids) for o in result.outputs] == [(o.text, o.token_ids) for o in expected]
    deltas = list(client.stream("resume-1", TIMEOUT_S))
    for output in result.outputs:
        mine = [d for d in deltas if d.index == output.index]
        assert [d.seq for d in mine] == list(range(len(mine)))  # numbering continued
        assert [t for d in mine for t in d.token_ids] == output.token_ids
        assert "".join(d.text for d in mine) == output.text
    assert all(d.prompt_logprobs is None for d in deltas)  # the ghost's first event had them
    rec = record(conn, keys, "resume-1")
    assert (rec.worker, rec.status, rec.entry_id) == (NAME, JobStatus.FINISHED, entry_id)


def test_entry_over_the_delivery_limit_goes_to_dead(client: Client, conn: redis.Redis) -> None:
    keys = client.keys
    entry_id = ghost_takes(conn, keys, encode_job(build_job("poison", GREEDY, job_id="poison-1")))
    age(conn, keys, entry_id, deliveries=5)  # five workers died running it
    letter = wait_for(lambda: dead_letters(conn, keys).get(entry_id), TIMEOUT_S, "dead letter")
    assert "delivered 6 times" in letter["reason"] and letter["id"] == "poison-1"
    with pytest.raises(JobFailed, match="delivery limit") as failure:
        client.result("poison-1", TIMEOUT_S)
    assert failure.value.error_type is None  # not the job's fault as far as anyone knows
    assert conn.xpending(keys.requests, keys.group)["pending"] == 0


def test_embedding_jobs_return_the_pooled_vector(client: Client, conn: redis.Redis, tiny_llama_dir, offline) -> None:
    """Embedding jobs (pooling_params set) beside generating ones: the vector on the final
    event and in the record is transformers' normalized last hidden state of the prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = ["An embedding of this", {"prompt_token_ids": [1, 450, 7483, 310]}]
    generating = client.submit("Generate meanwhile", GREEDY)
    handles = [client.submit(p, pooling_params=PoolingParams()) for p in prompts]
    raw = client.submit("raw vector", pooling_params=PoolingParams(normalize=False))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = [AutoTokenizer.from_pretrained(tiny_llama_dir).encode(prompts[0]), [1, 450, 7483, 310]]
    for handle, token_ids in zip(handles, ids, strict=True):
        result = handle.result(TIMEOUT_S)
        with torch.inference_mode():
            hidden = hf.model(torch.tensor([token_ids])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(hidden, dim=-1)
        torch.testing.assert_close(torch.tensor(result.embedding), expected, atol=1e-5, rtol=1e-4)
        assert (result.status, result.token_ids, result.finish_reason) == (JobStatus.FINISHED, [], "stop")
        assert result.usage["prompt_tokens"] == len(token_ids) and result.usage["completion_tokens"] == 0
        assert record(conn, client.keys, handle.id).embedding == result.embedding  # kept past the events
    assert abs(torch.tensor(raw.result(TIMEOUT_S).embedding).norm().item() - 1.0) > 1e-3
    assert generating.result(TIMEOUT_S).token_ids == offline("Generate meanwhile", GREEDY)[0].token_ids
    messages = [{"role": "user", "content": "hi"}]  # a conversation, as the template renders it without a reply
    chat = client.submit({"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}},
                         pooling_params=PoolingParams()).result(TIMEOUT_S)
    chat_ids = AutoTokenizer.from_pretrained(tiny_llama_dir).apply_chat_template(
        messages, add_generation_prompt=False, tokenize=True, return_dict=False)
    with torch.inference_mode():
        hidden = hf.model(torch.tensor([chat_ids])).last_hidden_state[0, -1]
    torch.testing.assert_close(torch.tensor(chat.embedding), torch.nn.functional.normalize(hidden, dim=-1),
                               atol=1e-5, rtol=1e-4)


def test_a_retried_dead_letter_runs_again(client: Client, conn: redis.Redis, offline) -> None:
    """After a crash loop is fixed, `genq dead retry` sends the job back: it runs from the
    start under its own id; a second retry, or one of a live job's duplicate entry, leaves it."""
    keys = client.keys
    entry_id = ghost_takes(conn, keys, encode_job(build_job("second chance", GREEDY, job_id="poison-2")))
    age(conn, keys, entry_id, deliveries=5)
    wait_for(lambda: dead_letters(conn, keys).get(entry_id), TIMEOUT_S, "dead letter")
    wait_for(lambda: ended(conn, keys, "poison-2"), TIMEOUT_S, "job failed")
    [letter] = [d for d in list_dead(client) if d.entry_id == entry_id]
    assert letter.job_id == "poison-2" and "delivery limit" in letter.reason
    assert retry_dead(client, letter).startswith(f"queued as {conn.hget(keys.job('poison-2'), 'entry_id').decode()}")
    result = client.result("poison-2", TIMEOUT_S)
    expected = offline("second chance", GREEDY)[0]
    assert (result.status, result.text, result.token_ids) == (JobStatus.FINISHED, expected.text, expected.token_ids)
    events = [decode_event(f[EVENT_FIELD.encode()]) for _, f in conn.xrange(keys.events("poison-2"))]
    assert [e.seq for e in events] == list(range(len(events))) and all(e.error is None for e in events)  # old error gone
    assert entry_id not in dead_letters(conn, keys)
    assert retry_dead(client, letter).startswith("left: it is no longer in the dead stream")
    twin = conn.xadd(keys.dead, encode_dead_letter(entry_id, encode_job(build_job("x", GREEDY, job_id="poison-2")),
                                                   "duplicate entry", "poison-2")).decode()
    [dup] = [d for d in list_dead(client) if d.dead_id == twin]
    assert retry_dead(client, dup) == "left: job poison-2 is finished (this was a duplicate entry of it)"


def test_entry_deleted_while_pending_goes_to_dead(client: Client, conn: redis.Redis) -> None:
    keys = client.keys
    entry_id = ghost_takes(conn, keys, encode_job(build_job("gone", GREEDY, job_id="gone-1")))
    conn.xdel(keys.requests, entry_id)  # Redis 6.2 keeps it pending, with no fields
    age(conn, keys, entry_id)
    letter = wait_for(lambda: dead_letters(conn, keys).get(entry_id), TIMEOUT_S, "dead letter")
    assert "deleted" in letter["reason"]
    assert conn.xpending(keys.requests, keys.group)["pending"] == 0
