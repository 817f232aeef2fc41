"""The wire protocol against a real Redis: round trips and every ProtocolError path."""

from __future__ import annotations

import time

import msgpack
import pytest
import redis

from producer.pooling_params import PoolingParams
from producer.protocol import (
    APPEND_EVENTS_LUA,
    EVENT_FIELD,
    EVENTS_TTL_S,
    PROTOCOL_VERSION,
    Event,
    Job,
    JobStatus,
    Keys,
    ProtocolError,
    decode_event,
    decode_job,
    encode_event,
    encode_job,
    pack,
    pack_embedding,
    unpack_embedding,
)
from producer.records import (
    CompletionOutput,
    JobRecord,
    decode_dead_letter,
    decode_record,
    encode_dead_letter,
    encode_record,
)
from producer.sampling_params import SamplingParams

KEYS = Keys()


def make_job(**overrides: object) -> Job:
    fields: dict = dict(
        id="job-1", sampling_params=SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"]),
        prompt="hello", priority=2, deadline=time.time() + 60, submit_time=time.time(),
    )
    fields.update(overrides)
    return Job(**fields)


def xadd_and_read(conn: redis.Redis, fields: dict) -> dict[bytes, bytes]:
    """Put an entry through the real stream and read back exactly what a worker would see."""
    entry_id = conn.xadd(KEYS.requests, fields)
    [(_, read)] = conn.xrange(KEYS.requests, entry_id, entry_id)
    return read


def payload_of(job: Job, **changes: object) -> bytes:
    payload = msgpack.unpackb(encode_job(job)["payload"])
    payload.update(changes)
    return pack(payload)


def test_key_names() -> None:
    assert (KEYS.requests, KEYS.group, KEYS.dead) == ("genq:requests", "genq:workers", "genq:dead")
    assert KEYS.job("a") == "genq:job:a"
    assert KEYS.events("a") == "genq:events:a"
    assert (KEYS.cancel_channel, KEYS.cancel_flag("a")) == ("genq:cancel", "genq:cancel:a")
    assert KEYS.worker("w1") == "genq:workers:w1"
    assert Keys("test:").job("a") == "test:job:a"


def test_job_status_values() -> None:
    assert [s.value for s in JobStatus] == ["queued", "running", "finished", "failed", "cancelled"]
    assert [s.terminal for s in JobStatus] == [False, False, True, True, True]


@pytest.mark.parametrize(
    "prompt_fields",
    [
        {"prompt": "hello"},
        {"prompt_token_ids": [1, 2, 3]},
        {"prompt_token_ids": [1, 2, 3], "cache_salt": "tenant-7-secret", "return_prompt_token_ids": True},
        {"prompt_embeds": b"PK\x03\x04 torch.save's bytes"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is "},
                                                   {"type": "image", "image": b"\x89PNG\r\n\x1a\n..."},
                                                   {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]},
    ],
)
def test_job_round_trip_through_redis(redis_conn: redis.Redis, prompt_fields: dict) -> None:
    job = make_job(**{"prompt": None, "model": "smol", **prompt_fields})
    read = xadd_and_read(redis_conn, encode_job(job))
    assert read[b"id"] == b"job-1" and read[b"priority"] == b"2"
    assert decode_job(read) == job


def test_token_keyed_sampling_params_round_trip(redis_conn: redis.Redis) -> None:
    params = SamplingParams(logit_bias={"50": -3.5, 7: 100}, allowed_token_ids=[7, 50])
    job = make_job(sampling_params=params)
    decoded = decode_job(xadd_and_read(redis_conn, encode_job(job)))
    assert decoded.sampling_params.logit_bias == {50: -3.5, 7: 100}
    assert decoded == job


def test_embedding_jobs_round_trip_and_carry_their_vector(redis_conn: redis.Redis) -> None:
    job = make_job(pooling_params=PoolingParams(normalize=False))
    entry = encode_job(job)
    assert decode_job(xadd_and_read(redis_conn, entry)) == job
    assert "pooling_params" not in msgpack.unpackb(encode_job(make_job())["payload"])  # generation: as before
    chat = make_job(prompt=None, messages=[{"role": "user", "content": "x"}], pooling_params=PoolingParams())
    assert decode_job(xadd_and_read(redis_conn, encode_job(chat))) == chat  # a conversation's embedding
    with pytest.raises(ValueError, match="one output, got n=2"):
        encode_job(make_job(sampling_params=SamplingParams(n=2), pooling_params=PoolingParams()))
    vector = [0.5, -1.25, 3.0e-8, 1.0]
    assert unpack_embedding(pack_embedding(vector)) == pytest.approx(vector, rel=1e-7)
    assert pack_embedding([1.0]) == b"\x00\x00\x80\x3f"  # float32, little-endian
    event = decode_event(encode_event(Event(seq=0, finished=True, embedding=pack_embedding(vector))))
    assert unpack_embedding(event.embedding) == pytest.approx(vector, rel=1e-7)
    redis_conn.hset("rec", mapping=encode_record(JobRecord(embedding=vector)))
    assert decode_record(redis_conn.hgetall("rec")).embedding == pytest.approx(vector, rel=1e-7)
    with pytest.raises(ProtocolError, match="float32s, got 3 bytes"):
        unpack_embedding(b"abc")


def test_chat_jobs_carry_tools(redis_conn: redis.Redis) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    job = make_job(prompt=None, messages=[{"role": "user", "content": "hi"}], tools=tools)
    assert decode_job(xadd_and_read(redis_conn, encode_job(job))).tools == tools
    with pytest.raises(ValueError, match="tools go with chat messages"):
        encode_job(make_job(tools=tools))
    with pytest.raises(ValueError, match=r"tools\[0\] must be"):
        encode_job(make_job(prompt=None, messages=[{"role": "user", "content": "hi"}], tools=[{"name": "f"}]))


def test_chat_jobs_carry_template_kwargs(redis_conn: redis.Redis) -> None:
    chat = {"prompt": None, "messages": [{"role": "user", "content": "hi"}]}
    kwargs = {"enable_thinking": False, "continue_final_message": True, "add_generation_prompt": False}
    job = make_job(**chat, chat_template_kwargs=kwargs)
    assert decode_job(xadd_and_read(redis_conn, encode_job(job))).chat_template_kwargs == kwargs
    for bad, message in [
        ({"tokenize": True, "chat_template": "{{ x }}"}, "may not set chat_template, tokenize"),
        ({"continue_final_message": "yes"}, "continue_final_message must be true or false"),
        ({"add_generation_prompt": True, "continue_final_message": True}, "add_generation_prompt and continue_final_message exclude"),
        ({"not a name": 1}, "must map names to values"),
    ]:
        with pytest.raises(ValueError, match=f"chat_template_kwargs {message}"):
            encode_job(make_job(**chat, chat_template_kwargs=bad))
    with pytest.raises(ValueError, match="chat_template_kwargs go with chat messages"):
        encode_job(make_job(chat_template_kwargs={}))


def test_decode_job_accepts_str_keys() -> None:
    job = make_job()
    entry = {k: v for k, v in encode_job(job).items()}
    assert decode_job(entry) == job


def test_garbage_entry_has_no_job_id(redis_conn: redis.Redis) -> None:
    read = xadd_and_read(redis_conn, {"foo": "bar"})
    with pytest.raises(ProtocolError, match="no 'id' field") as info:
        decode_job(read)
    assert info.value.job_id is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"id": "job-1"}, "no 'payload'"),
        ({"id": "job-1", "payload": b"\xc1\xc1"}, "not valid msgpack"),
        ({"id": "job-1", "payload": pack([1, 2])}, "payload must be a map"),
        ({"id": "job-1", "payload": pack({"id": "job-1"})}, "unsupported protocol version None"),
    ],
)
def test_undecodable_payload_names_the_job(
    redis_conn: redis.Redis, fields: dict, message: str
) -> None:
    with pytest.raises(ProtocolError, match=message) as info:
        decode_job(xadd_and_read(redis_conn, fields))
    assert info.value.job_id == "job-1"
    assert "job job-1" in str(info.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"version": PROTOCOL_VERSION + 1}, "unsupported protocol version 2"),
        ({"sampling_params": {"temperature": -1.0}}, "temperature must be finite and >= 0"),
        ({"sampling_params": {"beam_width": 4}}, "unknown sampling parameter.*beam_width"),
        ({"sampling_params": "greedy"}, "sampling_params must be a mapping"),
        ({"prompt_token_ids": [1]}, "exactly one of prompt, prompt_token_ids, messages"),
        ({"messages": [{"role": "user"}], "prompt": None}, r"messages\[0\].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "image": "not bytes"}]}], "prompt": None},
         r"messages\[0\].content\[0\] must be a text part, an image or audio part with bytes"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x"}}]}],
          "prompt": None}, r"messages\[0\].content\[0\] must be .* an image_url or audio_url part with a data URL"),
        ({"messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": "https://x/a.wav"}]}],
          "prompt": None}, r"messages\[0\].content\[0\] must be .* audio_url part with a data URL"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"format": "wav"}}]}],
          "prompt": None}, r"messages\[0\].content\[0\] must be .* or an input_audio part"),
        ({"priority": "high"}, "priority must be an integer"),
        ({"cache_salt": ""}, "cache_salt must be a non-empty string"),
        ({"return_prompt_token_ids": "yes"}, "return_prompt_token_ids must be true or false"),
        ({"extra": 1}, r"unknown \['extra'\]"),
        ({"id": "job-2"}, "differs from entry id"),
    ],
)
def test_invalid_payload_names_the_job(
    redis_conn: redis.Redis, changes: dict, message: str
) -> None:
    fields = {"id": "job-1", "priority": "0", "payload": payload_of(make_job(), **changes)}
    with pytest.raises(ProtocolError, match=message) as info:
        decode_job(xadd_and_read(redis_conn, fields))
    assert info.value.job_id == "job-1"


def test_missing_payload_fields_are_listed() -> None:
    payload = pack({"version": PROTOCOL_VERSION, "id": "job-1"})
    with pytest.raises(ProtocolError, match=r"missing \['sampling_params', 'submit_time'\]"):
        decode_job({b"id": b"job-1", b"payload": payload})


def test_non_utf8_id_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="is not UTF-8"):
        decode_job({b"id": b"\xff", b"payload": b""})


def test_str_payload_is_explained() -> None:
    with pytest.raises(ProtocolError, match="msgpack bytes, got str"):
        decode_job({"id": "job-1", "payload": "text"})


def test_encode_job_validates() -> None:
    with pytest.raises(ValueError, match="exactly one of prompt, prompt_token_ids, messages, prompt_embeds"):
        encode_job(make_job(prompt_token_ids=[1]))
    with pytest.raises(ValueError, match="prompt_embeds must be the non-empty bytes"):
        encode_job(make_job(prompt=None, prompt_embeds=b""))
    with pytest.raises(ValueError, match="job id"):
        encode_job(make_job(id="has space"))


def test_event_round_trip() -> None:
    event = Event(
        seq=3, token_ids=[5, 6], text="ab", finished=True, finish_reason="stop", stop_reason="\n",
        usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}, index=1,
        logprobs=[{5: -0.1}, {6: -0.2}], prompt_logprobs=[{"token": "hi"}, {"logprob": -1.5, "rank": 2}],
        prompt="hi there", prompt_token_ids=[1, 7, 7], time=1764915000.125,
    )
    assert decode_event(encode_event(event)) == event
    minimal = Event(seq=0)
    assert decode_event(encode_event(minimal)) == minimal
    assert decode_event(encode_event(Event(seq=1, stop_reason=2))).stop_reason == 2


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xc1", "event is not valid msgpack"),
        (pack([1]), "event must be a map"),
        (pack({"seq": 1}), "unsupported protocol version None"),
        (pack({"v": 99, "seq": 1}), "unsupported protocol version 99"),
        (pack({"v": PROTOCOL_VERSION}), "no 'seq'"),
        (pack({"v": PROTOCOL_VERSION, "seq": "1"}), "'seq' has type str"),
        (pack({"v": PROTOCOL_VERSION, "seq": True}), "'seq' has type bool"),
        (pack({"v": PROTOCOL_VERSION, "seq": 1, "finished": 1}), "'finished' has type int"),
        (pack({"v": PROTOCOL_VERSION, "seq": 1, "token_ids": ["a"]}), "token_ids must be integers"),
        (pack({"v": PROTOCOL_VERSION, "seq": 1, "prompt_token_ids": [1.5]}), "prompt_token_ids must be integers"),
        (pack({"v": PROTOCOL_VERSION, "seq": 1, "prompt": 7}), "'prompt' has type int"),
        (pack({"v": PROTOCOL_VERSION, "seq": -1}), "seq and index must be >= 0"),
        (pack({"v": PROTOCOL_VERSION, "seq": 1, "time": "now"}), "'time' has type str"),
        ("text", "msgpack bytes, got str"),
    ],
)
def test_bad_events(data: object, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode_event(data)  # type: ignore[arg-type]


def test_fields_from_a_newer_worker_are_skipped() -> None:
    """A rolling upgrade: an older reader takes what it knows and skips the rest."""
    event = decode_event(pack({"v": PROTOCOL_VERSION, "seq": 1, "text": "hi", "colour": "red"}))
    assert event == Event(seq=1, text="hi")
    output = {"index": 0, "text": "hi", "token_ids": [5], "colour": "red"}
    record = decode_record({b"status": b"finished", b"outputs": pack([output])})
    assert record.outputs == [CompletionOutput(0, "hi", [5])]


def test_record_is_readable_and_round_trips(redis_conn: redis.Redis) -> None:
    record = JobRecord(
        status=JobStatus.FINISHED, n=2, entry_id="1-0", worker="w1", submitted_at=1.5,
        started_at=2.25, finished_at=3.0, prompt_tokens=4, completion_tokens=6,
        finish_reason="stop", text="héllo", error=None,
        outputs=[CompletionOutput(0, "héllo", [1, 2], "stop", "\n"), CompletionOutput(1, "x", [3])],
        extra={"attempts": "2"},
    )
    redis_conn.hset(KEYS.job("j"), mapping=encode_record(record))
    raw = redis_conn.hgetall(KEYS.job("j"))
    assert raw[b"status"] == b"finished" and raw[b"text"] == "héllo".encode()
    assert raw[b"completion_tokens"] == b"6" and raw[b"started_at"] == b"2.25"
    assert b"error" not in raw  # None fields are not written
    assert decode_record(raw) == record
    assert record.usage == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({b"status": b"sleeping"}, "'sleeping' is not a valid JobStatus"),
        ({b"prompt_tokens": b"many"}, "invalid literal for int"),
        ({b"finished_at": b"noon"}, "could not convert string to float"),
        ({b"outputs": b"\xc1"}, "outputs is not valid msgpack"),
        ({b"outputs": pack([{"index": 0}])}, "outputs: .*missing"),
        ({b"outputs": pack({"index": 0})}, "outputs must be a list of maps"),
        ({b"text": b"\xff\xfe"}, "is not UTF-8"),
    ],
)
def test_bad_record_fields(raw: dict, message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as info:
        decode_record(raw, job_id="j")
    assert info.value.job_id == "j"


def test_dead_letter_round_trip(redis_conn: redis.Redis) -> None:
    fields = encode_dead_letter("5-0", {b"foo": b"bar"}, "no 'id' field")
    entry_id = redis_conn.xadd(KEYS.dead, fields)
    [(_, read)] = redis_conn.xrange(KEYS.dead, entry_id, entry_id)
    assert decode_dead_letter(read) == {
        "entry_id": "5-0", "id": None, "reason": "no 'id' field", "entry": {"foo": b"bar"}, "entry_bytes": None,
    }
    dropped = redis_conn.xadd(KEYS.dead, encode_dead_letter("6-0", {}, "too large", "j", entry_bytes=12345))
    [(_, read)] = redis_conn.xrange(KEYS.dead, dropped, dropped)
    assert decode_dead_letter(read)["entry_bytes"] == 12345 and decode_dead_letter(read)["entry"] == {}
    with pytest.raises(ProtocolError, match="missing"):
        decode_dead_letter({b"id": b"x"})


def test_append_events_writes_stream_and_channel_with_ttl(redis_conn: redis.Redis) -> None:
    pubsub = redis_conn.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(KEYS.events("j"))
    assert pubsub.get_message(timeout=1.0) is None  # swallow the confirmation
    events = [Event(seq=0, text="a"), Event(seq=1, text="b", finished=True)]
    append = redis_conn.register_script(APPEND_EVENTS_LUA)
    assert append(keys=[KEYS.events("j")], args=[EVENTS_TTL_S, *map(encode_event, events)]) == 2
    stored = [decode_event(f[EVENT_FIELD.encode()]) for _, f in redis_conn.xrange(KEYS.events("j"))]
    published = [decode_event(pubsub.get_message(timeout=1.0)["data"]) for _ in events]
    assert stored == published == events
    assert 0 < redis_conn.ttl(KEYS.events("j")) <= EVENTS_TTL_S
    pubsub.close()
