"""Usage metering: with API keys on, every job carries the id of the key it came with, and the
worker that finishes it adds its tokens to the day's usage, once, under that id and the
model. `GET /v1/usage` shows a key its own; `genq usage` shows the operator everyone's. The
oracle is the usage each response reported."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from batch_support import chat_line, read_file, run_batch, wait_done

from api.deps import key_id
from api.settings import Settings

KEYS = ("sk-one", "sk-two")
GREEDY = {"temperature": 0.0, "max_tokens": 5, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def keyed_url(live_worker: str, serve_api) -> Iterator[str]:
    with serve_api(Settings(redis_url=live_worker, api_keys=KEYS, request_timeout_s=60.0)) as url:
        yield url


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def totals(rows: list[dict[str, Any]]) -> tuple[int, int, int]:
    return (sum(r["requests"] for r in rows), sum(r["prompt_tokens"] for r in rows),
            sum(r["completion_tokens"] for r in rows))


def test_each_key_is_metered_its_own_tokens(
    keyed_url: str, live_worker: str, served_model: str, poll: Callable[..., Any]
) -> None:
    one, two = client(keyed_url, KEYS[0]), client(keyed_url, KEYS[1])
    chat = one.chat.completions.create(model=served_model, messages=[{"role": "user", "content": "Hi"}], **GREEDY)
    pair = one.completions.create(model=served_model, prompt="Once upon", n=2, **GREEDY)  # one job, two outputs
    vector = one.embeddings.create(model=served_model, input="metered too")
    long_prompt = "A prompt long enough to fill whole blocks of the prefix cache. " * 4
    cold, warm = (one.completions.create(model=served_model, prompt=long_prompt, **GREEDY) for _ in range(2))
    solo = two.completions.create(model=served_model, prompt="Twice upon", **GREEDY)
    done = wait_done(two, run_batch(two, [chat_line("b1", served_model)]).id, poll)  # the batch's creator pays
    assert done.status == "completed"
    batched = read_file(two, done.output_file_id)["b1"]["response"]["body"]["usage"]

    with httpx.Client(base_url=keyed_url, timeout=30) as http:
        mine = http.get("/v1/usage", headers={"Authorization": f"Bearer {KEYS[0]}"}).json()
        theirs = http.get("/v1/usage", params={"days": 1}, headers={"Authorization": f"Bearer {KEYS[1]}"}).json()
        bad = http.get("/v1/usage", params={"days": 0}, headers={"Authorization": f"Bearer {KEYS[0]}"})
        anonymous = http.get("/v1/usage")
    assert mine["tenant"] == key_id(KEYS[0]) and {r["tenant"] for r in mine["data"]} == {key_id(KEYS[0])}
    assert {r["model"] for r in mine["data"]} == {served_model}
    texts = (chat, pair, cold, warm)
    prompt = sum(r.usage.prompt_tokens for r in texts) + vector.usage.prompt_tokens
    assert totals(mine["data"]) == (5, prompt, sum(r.usage.completion_tokens for r in texts))
    cached = sum(r["cached_tokens"] for r in mine["data"])  # as each response said: at least the warm request's prompt
    assert cached == sum(r.usage.prompt_tokens_details.cached_tokens or 0 for r in texts if r.usage.prompt_tokens_details)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert {r["tenant"] for r in theirs["data"]} == {key_id(KEYS[1])}
    assert totals(theirs["data"]) == (2, solo.usage.prompt_tokens + batched["prompt_tokens"],
                                      solo.usage.completion_tokens + batched["completion_tokens"])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "days"
    assert anonymous.status_code == 401

    out = subprocess.run([sys.executable, "-m", "producer.cli", "usage", "--redis-url", live_worker, "--json"],
                         capture_output=True, text=True, timeout=30)
    rows = json.loads(out.stdout)
    assert {r["tenant"] for r in rows} >= {key_id(KEYS[0]), key_id(KEYS[1])}
    assert sum(r["requests"] for r in rows if r["tenant"] == key_id(KEYS[0])) == 5
    table = subprocess.run([sys.executable, "-m", "producer.cli", "usage", "--redis-url", live_worker],
                           capture_output=True, text=True, timeout=30).stdout
    assert table.splitlines()[0].split() == ["day", "tenant", "model", "requests", "prompt_tokens",
                                             "cached_tokens", "completion_tokens", "total_tokens"]
    assert key_id(KEYS[1]) in table


def test_each_key_has_its_own_requests_per_minute(live_worker: str, serve_api, served_model: str) -> None:
    keys = ("rate-a", "rate-b", "rate-c", "rate-other")
    settings = Settings(redis_url=live_worker, api_keys=keys, rate_limit_rpm=2, request_timeout_s=60.0)
    body = {"model": served_model, "prompt": "Rate me", "max_tokens": 2}
    with serve_api(settings) as url, httpx.Client(base_url=url, timeout=60) as http:
        def post(key: str) -> httpx.Response:
            return http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})

        for key in keys[:3]:  # the window is the clock's minute: a fresh key if one ended mid-way
            minute = int(time.time() // 60)
            first = [post(key).status_code for _ in range(2)]
            limited = post(key)
            if int(time.time() // 60) == minute:
                break
        other = post(keys[3])
        models = http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert first == [200, 200] and other.status_code == 200 and models.status_code == 200
    assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(limited.headers["Retry-After"]) <= 60


def test_each_key_has_its_own_tokens_per_minute(live_worker: str, serve_api, served_model: str) -> None:
    """Once a key's jobs used its tokens this minute, it gets a 429 until the next minute;
    another key does not."""
    keys = ("tpm-a", "tpm-b", "tpm-c", "tpm-other")
    settings = Settings(redis_url=live_worker, api_keys=keys, rate_limit_tpm=20, request_timeout_s=60.0)
    body = {"model": served_model, "prompt": "Count my tokens", "max_tokens": 8, "ignore_eos": True}
    with serve_api(settings) as url, httpx.Client(base_url=url, timeout=60) as http:
        def post(key: str) -> httpx.Response:
            return http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})

        for key in keys[:3]:  # the window is the clock's minute: a fresh key if one ended mid-way
            minute = int(time.time() // 60)
            first = post(key)
            used = first.json()["usage"]["total_tokens"]
            second = post(key) if used < 20 else first  # under the limit still: admitted
            limited = post(key)
            if int(time.time() // 60) == minute:
                break
        other = post(keys[3])
    assert first.status_code == 200 and second.status_code == 200 and other.status_code == 200
    assert used + (second.json()["usage"]["total_tokens"] if second is not first else 0) >= 20
    assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert "20 tokens per minute" in limited.json()["error"]["message"]
    assert 1 <= int(limited.headers["Retry-After"]) <= 60


def test_a_running_generation_counts_against_its_keys_minute(live_worker: str, serve_api, served_model: str) -> None:
    """The tokens of a generation still streaming count as they come: once they pass the
    limit, the key's next request gets a 429 while the first still runs."""
    keys = ("run-a", "run-b", "run-c")
    settings = Settings(redis_url=live_worker, api_keys=keys, rate_limit_tpm=30, request_timeout_s=60.0)
    body = {"model": served_model, "prompt": "Count", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with serve_api(settings) as url, httpx.Client(base_url=url, timeout=60) as http:
        for key in keys:  # the window is the clock's minute: a fresh key if one ended mid-way
            minute = int(time.time() // 60)
            auth = {"Authorization": f"Bearer {key}"}
            with http.stream("POST", "/v1/completions", json=body, headers=auth) as stream:
                tokens = 0
                for line in stream.iter_lines():  # (a chunk may carry several tokens: coalesced events)
                    if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                        tokens = usage["completion_tokens"]
                    if tokens >= 40:
                        break
                limited = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 1}, headers=auth)
            if int(time.time() // 60) == minute:
                break
    assert 40 <= tokens < 400  # more than the limit, and short of the 400 asked for: still running
    assert limited.status_code == 429 and "30 tokens per minute" in limited.json()["error"]["message"]
