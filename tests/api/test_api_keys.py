"""API keys kept in Redis (`genq keys`, api.api_keys) against a live stack, driven by the
official `openai` client: once one exists the API asks for a key; each key is metered under
its name, keeps its own requests per minute and sees only its models; a revoked key stops
working; GENQ_API_KEYS keys work beside them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import redis
import redis.asyncio
from batch_support import chat_line, run_batch

from api import api_keys
from api.api_keys import KeyPlan
from api.deps import key_id
from api.settings import Settings
from producer.protocol import LANE_HIGH, LANE_LOW, LANE_NORMAL, Keys, decode_job

STATIC = "sk-static"
GREEDY = {"temperature": 0.0, "max_tokens": 2}


def genq_keys(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer.cli", "keys", "--redis-url", redis_url, *args],
                          capture_output=True, text=True, timeout=60)


def create(redis_url: str, plan: KeyPlan) -> str:
    async def run() -> str:
        conn = redis.asyncio.Redis.from_url(redis_url)
        try:
            return await api_keys.create(conn, Keys(), plan)
        finally:
            await conn.aclose()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def url(live_worker: str, serve_api) -> Iterator[str]:
    """An API with one static key, on the shared Redis; the managed keys are gone after (the
    other modules' APIs on this Redis are open)."""
    conn = redis.Redis.from_url(live_worker)
    try:
        with serve_api(Settings(redis_url=live_worker, api_keys=(STATIC,), request_timeout_s=60.0)) as served:
            yield served
    finally:
        conn.delete(Keys().api_keys)
        conn.close()


def oai(url: str, key: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key or "none", max_retries=0, timeout=60)


def test_a_key_made_by_genq_keys_is_metered_under_its_name(url: str, live_worker: str, served_model: str) -> None:
    made = genq_keys(live_worker, "create", "acme", "--rpm", "100")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("sk-genq-")
    reply = oai(url, key).completions.create(model=served_model, prompt="Hi", **GREEDY)
    with httpx.Client(base_url=url, timeout=30) as http:
        usage = http.get("/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
    assert usage["tenant"] == "acme"
    assert sum(r["completion_tokens"] for r in usage["data"]) == reply.usage.completion_tokens
    listed = genq_keys(live_worker, "ls").stdout
    assert listed.splitlines()[0].split() == ["NAME", "RPM", "TPM", "IN-FLIGHT", "MODELS", "PRIORITY", "CREATED"]
    assert listed.splitlines()[1].split()[:6] == ["acme", "100", "default", "default", "all", "0"]
    assert key not in listed and key not in str(redis.Redis.from_url(live_worker).hgetall(Keys().api_keys))
    taken = genq_keys(live_worker, "create", "acme")
    assert taken.returncode == 1 and "a key named 'acme' exists" in taken.stderr
    bad = genq_keys(live_worker, "create", "key-x")
    assert bad.returncode == 1 and "not starting with 'key-'" in bad.stderr


def test_a_managed_key_existing_closes_the_api_to_requests_without_one(
    url: str, live_worker: str, served_model: str, serve_api, poll: Callable[..., Any]
) -> None:
    """An API started without GENQ_API_KEYS is open until a managed key exists; a static key
    works beside the managed ones and is metered as before."""
    redis.Redis.from_url(live_worker).delete(Keys().api_keys)
    with serve_api(Settings(redis_url=live_worker, request_timeout_s=60.0)) as open_url:
        assert oai(open_url, None).models.list().data
        key = create(live_worker, KeyPlan("closer"))

        def closed() -> bool:
            try:
                oai(open_url, None).models.list()
            except openai.AuthenticationError:
                return True
            return False

        poll(closed, 10.0, "the API asking for a key")
        with pytest.raises(openai.AuthenticationError):
            oai(open_url, "sk-genq-guessed").models.list()
        assert oai(open_url, key).models.list().data
    static = oai(url, STATIC).completions.create(model=served_model, prompt="Hi", **GREEDY)
    assert static.usage.completion_tokens == 2
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/v1/usage", headers={"Authorization": f"Bearer {STATIC}"}).json()["tenant"] == key_id(STATIC)


def test_a_key_sees_and_uses_only_its_models(url: str, live_worker: str, served_model: str,
                                             poll: Callable[..., Any]) -> None:
    allowed = oai(url, create(live_worker, KeyPlan("mine", models=(served_model,))))
    barred = oai(url, create(live_worker, KeyPlan("barred", models=("some-other-model",))))
    assert [m.id for m in allowed.models.list()] == [served_model]
    assert allowed.chat.completions.create(model=served_model, messages=[{"role": "user", "content": "Hi"}],
                                           **GREEDY).choices[0].message.content is not None
    assert barred.models.list().data == []
    with pytest.raises(openai.NotFoundError) as info:
        barred.chat.completions.create(model=served_model, messages=[{"role": "user", "content": "Hi"}], **GREEDY)
    assert info.value.body["code"] == "model_not_found" and "may not use it" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        barred.completions.create(model=None, prompt="Hi", **GREEDY)  # not even by default
    with pytest.raises(openai.NotFoundError):
        barred.models.retrieve(served_model)
    batch = run_batch(barred, [chat_line("b1", served_model)])  # its lines are checked as they are stored
    assert batch.status == "failed" and batch.errors.data[0].code == "model_not_found"


def test_a_key_has_its_own_requests_per_minute(url: str, live_worker: str, served_model: str) -> None:
    """Two a minute for this key (none for the API's others): its third is refused."""
    for attempt in range(3):  # the window is the clock's minute: a fresh key if one ended mid-way
        client = oai(url, create(live_worker, KeyPlan(f"slow-{attempt}", rpm=2)))
        minute = int(time.time() // 60)
        firsts = [client.completions.create(model=served_model, prompt="Hi", **GREEDY) for _ in range(2)]
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=served_model, prompt="Hi", **GREEDY)
        if int(time.time() // 60) == minute:
            break
    assert len(firsts) == 2 and "2 requests per minute" in info.value.body["message"]
    assert oai(url, STATIC).completions.create(model=served_model, prompt="Hi", **GREEDY).usage is not None


def test_genq_keys_set_changes_a_plan_and_keeps_the_key(url: str, live_worker: str, served_model: str,
                                                        poll: Callable[..., Any]) -> None:
    """A key barred from every model is let through by `set --models all`, its tier lowered
    by `--priority -2`, its rpm back to the server's; unknown names and empty changes fail."""
    made = genq_keys(live_worker, "create", "bronze", "--models", "nothing-served", "--rpm", "7")
    client = oai(url, made.stdout.strip())
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=served_model, prompt="Hi", **GREEDY)
    changed = genq_keys(live_worker, "set", "bronze", "--models", "all", "--priority", "-2", "--rpm", "default")
    assert changed.returncode == 0, changed.stderr
    assert changed.stdout.splitlines()[1].split()[:6] == ["bronze", "default", "default", "default", "all", "-2"]

    def served() -> Any:
        try:
            return client.completions.create(model=served_model, prompt="Upgraded", **GREEDY)
        except openai.NotFoundError:
            return None  # the API's plan is at most a second old

    assert poll(served, 10, "the changed plan taken").usage is not None
    [(_, fields)] = redis.Redis.from_url(live_worker).xrevrange(Keys().on_lane(LANE_HIGH).requests, count=1)
    assert (decode_job(fields).prompt, decode_job(fields).priority, decode_job(fields).tenant) == ("Upgraded", -2, "bronze")
    missing = genq_keys(live_worker, "set", "nobody", "--rpm", "3")
    assert missing.returncode == 1 and "no key named 'nobody'" in missing.stderr
    empty = genq_keys(live_worker, "set", "bronze")
    assert empty.returncode == 1 and "name what to change" in empty.stderr
    assert genq_keys(live_worker, "set", "bronze", "--rpm", "0").returncode == 1  # check_plan: at least 1


def test_a_plan_change_never_brings_a_revoked_key_back(live_worker: str) -> None:
    async def run() -> None:
        conn, keys = redis.asyncio.Redis.from_url(live_worker), Keys("cas-test:")
        try:
            await api_keys.create(conn, keys, KeyPlan("racing"))
            [(field, read)] = (await conn.hgetall(keys.api_keys)).items()
            await api_keys.update(conn, keys, "racing", rpm=5)  # another change since `read`
            assert not await api_keys.set_plan(conn, keys, field, read, KeyPlan("racing", priority=-9))
            assert KeyPlan.from_json(await conn.hget(keys.api_keys, field)).rpm == 5
            [(_, read)] = (await conn.hgetall(keys.api_keys)).items()
            await api_keys.revoke(conn, keys, "racing")
            assert not await api_keys.set_plan(conn, keys, field, read, KeyPlan("racing", priority=-9))
            assert not await conn.exists(keys.api_keys)
            # changes made at once: each that finds the plan changed reads it again, none is lost
            await api_keys.create(conn, keys, KeyPlan("busy"))
            await asyncio.gather(*(api_keys.update(conn, keys, "busy", **{field: 7}) for field in (
                "rpm", "tpm", "max_in_flight", "priority")))
            [plan] = [KeyPlan.from_json(v) for v in (await conn.hgetall(keys.api_keys)).values()]
            assert (plan.rpm, plan.tpm, plan.max_in_flight, plan.priority) == (7, 7, 7, 7)
        finally:
            await conn.delete(keys.api_keys)
            await conn.aclose()

    asyncio.run(run())


def test_a_revoked_key_stops_working(url: str, live_worker: str, poll: Callable[..., Any]) -> None:
    client = oai(url, create(live_worker, KeyPlan("leaving")))
    assert client.models.list().data
    revoked = genq_keys(live_worker, "revoke", "leaving")
    assert revoked.returncode == 0 and revoked.stdout.strip() == "revoked leaving"
    assert genq_keys(live_worker, "revoke", "leaving").returncode == 1

    def refused() -> bool:
        try:
            client.models.list()
        except openai.AuthenticationError:
            return True
        return False

    poll(refused, 10.0, "the revoked key refused")


def test_a_keys_priority_tiers_its_jobs_and_beam_search_is_metered_to_it(
    url: str, live_worker: str, served_model: str
) -> None:
    """A key made with --priority -5 (a tier scheduled first): its jobs carry the request's
    priority plus -5 (a negative one counting as 0), and wait in the high lane. Beam search's
    jobs, one a step and beam, are metered to the key too."""
    made = genq_keys(live_worker, "create", "gold", "--priority", "-5")
    gold = oai(url, made.stdout.strip())
    gold.completions.create(model=served_model, prompt="Tiered", extra_body={"priority": 2}, **GREEDY)
    conn = redis.Redis.from_url(live_worker)
    [(_, fields)] = conn.xrevrange(Keys().on_lane(LANE_HIGH).requests, count=1)
    job = decode_job(fields)
    assert (job.prompt, job.priority, job.tenant) == ("Tiered", -3, "gold")
    # a request may lower its precedence, never raise it past its key's tier
    gold.completions.create(model=served_model, prompt="Jumping", extra_body={"priority": -50}, **GREEDY)
    [(_, fields)] = conn.xrevrange(Keys().on_lane(LANE_HIGH).requests, count=1)
    assert (decode_job(fields).prompt, decode_job(fields).priority) == ("Jumping", -5)
    gold.completions.create(model=served_model, prompt="Beams", n=2, max_tokens=3,
                            extra_body={"use_beam_search": True})
    beams = [b for b in (decode_job(f) for _, f in conn.xrevrange(Keys().on_lane(LANE_HIGH).requests, count=6)) if b.prompt is None]
    assert len(beams) >= 3 and all(b.tenant == "gold" and b.priority == -5 for b in beams)


def test_service_tier_picks_the_lane_and_the_reply_names_it(url: str, live_worker: str, served_model: str) -> None:
    """OpenAI's service_tier as vLLM maps it to a priority (flex 2, priority -2), whose sign
    picks the lane; an explicit priority wins; replies name the tier their jobs ran on, which a
    managed key's request cannot raise past its key's."""
    conn = redis.Redis.from_url(live_worker)

    def last_job(lane: str):
        return decode_job(conn.xrevrange(Keys().on_lane(lane).requests, count=1)[0][1])

    static = oai(url, STATIC)
    hello = [{"role": "user", "content": "Hello"}]
    reply = static.chat.completions.create(model=served_model, messages=hello, service_tier="flex", **GREEDY)
    assert reply.service_tier == "flex" and last_job(LANE_LOW).priority == 2
    chunks = list(static.chat.completions.create(model=served_model, messages=hello, service_tier="priority",
                                                 stream=True, **GREEDY))
    assert {c.service_tier for c in chunks} == {"priority"} and last_job(LANE_HIGH).priority == -2
    explicit = static.completions.create(model=served_model, prompt="Hi", extra_body={"service_tier": "flex", "priority": 0},
                                         **GREEDY)
    assert explicit.service_tier == "default" and last_job(LANE_NORMAL).prompt == "Hi"
    response = static.responses.create(model=served_model, input="Hi", service_tier="flex", max_output_tokens=2,
                                       temperature=0.0)
    assert response.service_tier == "flex" and last_job(LANE_LOW).messages is not None
    managed = oai(url, genq_keys(live_worker, "create", "standard").stdout.strip())
    held = managed.chat.completions.create(model=served_model, messages=hello, service_tier="priority", **GREEDY)
    assert held.service_tier == "default"  # its key's tier holds
    with pytest.raises(openai.BadRequestError, match="service_tier"):
        static.chat.completions.create(model=served_model, messages=hello, extra_body={"service_tier": "fast"}, **GREEDY)


def test_a_key_has_its_own_jobs_in_flight(url: str, live_worker: str, served_model: str,
                                          poll: Callable[..., Any]) -> None:
    """One job in flight for this key: while its background response runs, another request
    is refused; once it ended (cancelled here), the key may submit again. A request that ended
    frees its place at once."""
    client = oai(url, genq_keys(live_worker, "create", "single", "--max-in-flight", "1").stdout.strip())
    assert client.completions.create(model=served_model, prompt="Hi", **GREEDY).usage.completion_tokens == 2
    assert client.completions.create(model=served_model, prompt="Again", **GREEDY).usage is not None  # freed
    long = client.responses.create(model=served_model, input="Go on.", background=True, max_output_tokens=900,
                                   extra_body={"ignore_eos": True})
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=served_model, prompt="Meanwhile", **GREEDY)
    assert "1 jobs in flight for this API key, which may have 1 at once" in info.value.body["message"]
    assert oai(url, STATIC).completions.create(model=served_model, prompt="Others", **GREEDY).usage is not None
    client.responses.cancel(long.id)

    def admitted() -> bool:
        try:
            return client.completions.create(model=served_model, prompt="After", **GREEDY).usage is not None
        except openai.RateLimitError:
            return False

    poll(admitted, 30.0, "the key's place freed")
    # requests made at once: the check and the count are one step, so one of them runs
    racing = oai(url, genq_keys(live_worker, "create", "racer", "--max-in-flight", "1").stdout.strip())

    def attempt(k: int) -> bool:
        try:
            return racing.completions.create(model=served_model, prompt=f"Race {k}", max_tokens=400,
                                             extra_body={"ignore_eos": True}).usage is not None
        except openai.RateLimitError:
            return False

    with ThreadPoolExecutor(6) as pool:
        assert sorted(pool.map(attempt, range(6))) == [False] * 5 + [True]


def test_a_beam_search_holds_a_place_per_beam_until_it_ends(url: str, live_worker: str, served_model: str,
                                                             poll: Callable[..., Any]) -> None:
    """A beam search of width 2 runs a job per beam at every step: its key's two places are
    taken from its start to its end (not only each step's jobs, which would leave room between
    steps), so a request beside it is refused, and one after it is not."""
    client = oai(url, create(live_worker, KeyPlan("beams", max_in_flight=2)))

    def search() -> Any:
        return client.completions.create(model=served_model, prompt="Beams", max_tokens=60, n=2,
                                         extra_body={"use_beam_search": True, "ignore_eos": True})

    def refused() -> bool:
        try:
            client.completions.create(model=served_model, prompt="Beside", **GREEDY)
            return False
        except openai.RateLimitError as exc:
            return "jobs in flight for this API key, which may have 2 at once" in exc.body["message"]

    with ThreadPoolExecutor(1) as pool:
        beams = pool.submit(search)
        poll(lambda: refused() or beams.done(), 60.0, "a request refused beside the search, or its end")
        assert not beams.done()  # a request beside it was refused while it ran
        assert len(beams.result().choices) == 2
    assert client.completions.create(model=served_model, prompt="After", **GREEDY).usage is not None
