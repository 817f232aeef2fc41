"""Error paths of a live API (uvicorn + real Redis) with no worker: 400 in OpenAI's format
naming the field, 401 without a valid key, 429 under backpressure, 404, 503 health; and the
API's import boundary."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version

import httpx
import openai
import pytest

from api.settings import Settings
from producer.redis_server import RedisServer, free_port

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def bare_url(redis_server: RedisServer, serve_api) -> Iterator[str]:
    with serve_api(Settings(redis_url=redis_server.url, max_queued_jobs=None)) as url:
        yield url


@pytest.fixture
def bare(bare_url: str, redis_url: str) -> Iterator[httpx.Client]:
    """A client of the worker-less API; `redis_url` flushes the database first."""
    with httpx.Client(base_url=bare_url, timeout=10.0) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["message"]
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": "m", "prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "x", "n": "many"}, "n"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"model": "m", "prompt": "x", "stop_token_ids": [-1]},
         "stop_token_ids"),
        ("/v1/completions", {"model": "m"}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": ""}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": [[1, -2]]}, "prompt"),
        ("/v1/chat/completions", {"model": "m"}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]}, "messages[0].content[0]"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "presence_penalty": 3}, "presence_penalty"),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
        ("/v1/chat/completions", {**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tool_choice"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 250}}, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}},
         "response_format"),
        ("/v1/completions", {"model": "m", "prompt": "x", "guided_choice": []}, "guided_choice"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": "object"}}}, "response_format"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}}, "response_format"),
        ("/v1/completions", {"model": "m", "prompt": "x", "guided_json": "{not json"}, "guided_json"),
        ("/v1/completions", {"model": "m", "prompt": "x", "guided_json": "[1, 2]"}, "guided_json"),
        ("/v1/completions", {"model": "m", "prompt": "x", "guided_regex": ""}, "guided_regex"),
        ("/v1/chat/completions",
         {**CHAT, "guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logit_bias": {"five": 1}}, "logit_bias"),
        ("/v1/completions", {"model": "m", "prompt": "x", "allowed_token_ids": []},
         "allowed_token_ids"),
        ("/v1/jobs", {"kind": "chat", "prompt": "x"}, "messages"),
        ("/v1/jobs", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/jobs", {"prompt": "a", "job_id": "has space"}, "job_id"),
        ("/v1/jobs", {"prompt": "a", "deadline_s": -1}, "deadline_s"),
        ("/v1/jobs", {"prompt": "a", "echo": True}, "echo"),
        # empty inputs, on every endpoint that queues work (none may run on to max_model_len)
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": ""}]}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": []}]}, "messages[0].content"),
        ("/v1/responses", {"input": ""}, "input"),
        ("/v1/responses", {"input": []}, "input"),
        ("/v1/responses", {"input": [{"role": "user", "content": ""}]}, "input"),
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": [[]]}, "input"),
        ("/pooling", {"input": []}, "input"),
        ("/classify", {"input": ""}, "input"),
        ("/score", {"text_1": "", "text_2": "a"}, "text_1"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
        ("/v1/jobs", {"prompt": ""}, "prompt"),
        ("/v1/jobs", {"kind": "chat", "messages": []}, "messages"),
        ("/invocations", {"messages": []}, "messages"),
    ],
)
def test_validation_errors_are_400_naming_the_field(
    bare: httpx.Client, path: str, body: dict, param: str
) -> None:
    error = assert_openai_error(bare.post(path, json=body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("messages", [[], [{"role": "user", "content": ""}],
                                      [{"role": "user", "content": "hi"}, {"role": "assistant", "content": []},
                                       {"role": "user", "content": "again"}]])
def test_empty_messages_are_anthropics_400(bare: httpx.Client, messages: list) -> None:
    """Anthropic's rule: every message has content, but a final assistant one (a prefill)."""
    response = bare.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": messages})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert response.json()["error"]["message"].startswith("messages")


def test_a_bad_prompt_in_a_list_enqueues_nothing(bare: httpx.Client, redis_conn) -> None:
    response = bare.post("/v1/completions", json={"model": "m", "prompt": [[1, 2], [3, -4]]})
    assert_openai_error(response, 400, "prompt")
    assert redis_conn.xlen("genq:requests") == 0


def test_malformed_json_is_400(bare: httpx.Client) -> None:
    response = bare.post(
        "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert_openai_error(response, 400, None)


def test_unknown_jobs_are_404(bare: httpx.Client) -> None:
    for response in (bare.get("/v1/jobs/nope"), bare.get("/v1/jobs/nope/events"),
                     bare.delete("/v1/jobs/nope")):
        assert assert_openai_error(response, 404, None)["code"] == "job_not_found"


def test_bad_last_event_id_is_400(bare: httpx.Client) -> None:
    job_id = bare.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
    response = bare.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "x:y"})
    assert_openai_error(response, 400, "Last-Event-ID")


def test_api_keys_guard_every_v1_route(
    redis_server: RedisServer, redis_url: str, serve_api
) -> None:
    with serve_api(Settings(redis_url=redis_server.url, api_keys=("k1", "k2"))) as url:
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.models.list()
        assert info.value.status_code == 401
        with httpx.Client(base_url=url) as http:
            for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                 ("POST", "/v1/chat/completions"), ("POST", "/v1/jobs"),
                                 ("GET", "/v1/jobs/x"), ("DELETE", "/v1/jobs/x")]:
                response = http.request(method, path, json={})
                assert assert_openai_error(response, 401, None)["code"] == "invalid_api_key"
            assert http.get("/metrics").status_code == 200  # scrapers and probes need no key
            assert http.get("/health").status_code == 503  # (no worker), but not 401
            guarded = guarded_operations(http.get("/openapi.json").json())
            assert len(guarded) > 50  # every route the spec says is behind the key check
            for method, path in guarded:
                response = http.request(method, path, json={})
                assert response.status_code == 401, (method, path, response.text)
        right = openai.OpenAI(base_url=f"{url}/v1", api_key="k2", max_retries=0)
        assert [m.id for m in right.models.list()] == ["genq"]


def guarded_operations(spec: dict) -> list[tuple[str, str]]:
    """(method, path) of each operation the spec says answers 401, path parameters filled."""
    out = []
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            if "401" in operation.get("responses", {}):
                out.append((method.upper(), re.sub(r"\{[^}]+\}", "x", path)))
    return out


def test_backpressure_is_429_with_retry_after(
    redis_server: RedisServer, redis_url: str, serve_api
) -> None:
    settings = Settings(redis_url=redis_server.url, max_queued_jobs=2, retry_after_s=7)
    with serve_api(settings) as url, httpx.Client(base_url=url) as http:
        for i in range(2):  # nobody consumes: the queue only grows
            assert http.post("/v1/jobs", json={"prompt": f"p{i}"}).status_code == 202
        response = http.post("/v1/jobs", json={"prompt": "one too many"})
        assert assert_openai_error(response, 429, None)["code"] == "queue_full"
        assert response.headers["Retry-After"] == "7"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


def test_runtime_lora_loading_needs_every_worker_to_serve_adapters(
    redis_server: RedisServer, redis_url: str, redis_conn, serve_api
) -> None:
    """With no worker live an adapter is registered for workers to load as they start; with a
    worker whose heartbeat says LoRA is off, loading is refused, since its jobs could land there."""
    import time

    from producer.protocol import Keys
    from producer.records import WorkerInfo, encode_worker_info

    keys = Keys()
    settings = Settings(redis_url=redis_server.url, allow_runtime_lora_updating=True)
    with serve_api(settings) as url, httpx.Client(base_url=url) as http:
        early = http.post("/v1/load_lora_adapter", json={"lora_name": "early", "lora_path": "/adapters/early"})
        assert early.status_code == 200 and "no worker is live" in early.text
        assert redis_conn.hgetall(keys.lora_adapters) == {b"early": b"/adapters/early"}
        beat = WorkerInfo(model="m", max_num_seqs=8, max_loras=0, heartbeat_at=time.time())
        redis_conn.hset(keys.worker("w-no-lora"), mapping=encode_worker_info(beat))
        refused = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "/adapters/late"})
        message = assert_openai_error(refused, 400, "lora_name")["message"]
        assert "w-no-lora do not serve LoRA adapters" in message
        assert redis_conn.hkeys(keys.lora_adapters) == [b"early"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "early"}).status_code == 200
        assert redis_conn.hgetall(keys.lora_adapters) == {}


def test_a_body_over_max_request_bytes_is_413_before_anything_is_queued(
    redis_server: RedisServer, redis_url: str, redis_conn, serve_api
) -> None:
    """GENQ_MAX_REQUEST_BYTES: refused at the door whether the body declares its length or
    comes chunked, in OpenAI's shape (Anthropic's under /v1/messages); a body under it passes,
    and multipart uploads keep their own limit."""
    big = {"model": "m", "prompt": "x" * 2000}
    settings = Settings(redis_url=redis_url, max_request_bytes=1000, max_queued_jobs=None)
    with serve_api(settings) as url, httpx.Client(base_url=url, timeout=10) as http:
        declared = http.post("/v1/completions", json=big)
        error = assert_openai_error(declared, 413, None)
        size = len(httpx.Request("POST", url, json=big).read())
        assert error["code"] == "request_too_large" and f"{size} bytes, over this server's limit of 1000" in error["message"]
        chunked = http.post("/v1/completions", content=iter([b'{"model": "m", "prompt": "', b"x" * 2000, b'"}']),
                            headers={"Content-Type": "application/json"})
        assert "over this server's limit of 1000" in assert_openai_error(chunked, 413, None)["message"]
        anthropic = http.post("/v1/messages", json={"model": "m", "max_tokens": 4,
                                                    "messages": [{"role": "user", "content": "x" * 2000}]})
        assert anthropic.status_code == 413 and anthropic.json()["error"]["type"] == "request_too_large"
        assert redis_conn.xlen("genq:requests") == 0
        assert http.post("/v1/jobs", json={"prompt": "small"}).status_code == 202
        upload = http.post("/v1/files", files={"file": ("a.jsonl", b"x" * 5000)}, data={"purpose": "batch"})
        assert upload.status_code == 200 and upload.json()["bytes"] == 5000


def test_tokenize_is_503_until_a_worker_published_its_tokenizer(bare: httpx.Client) -> None:
    response = bare.post("/tokenize", json={"prompt": "hello"})
    assert assert_openai_error(response, 503, None)["code"] == "tokenizer_unavailable"


def test_health_is_503_without_worker_or_redis(bare: httpx.Client, serve_api) -> None:
    response = bare.get("/health")
    assert response.status_code == 503 and response.json()["reason"] == "no live worker"
    nothing_there = f"redis://127.0.0.1:{free_port()}/0"
    with serve_api(Settings(redis_url=nothing_there)) as url, httpx.Client(base_url=url) as http:
        response = http.get("/health")
        assert response.status_code == 503
        assert "Redis unreachable" in response.json()["reason"]


def test_redis_away_is_503_with_retry_after_and_the_api_serves_again_when_it_is_back(serve_api) -> None:
    """A real Redis stopped and started again on the same port: meanwhile every route that needs
    it answers 503 redis_unavailable with Retry-After (a stream too, before it starts); after,
    the same API process serves again by itself, streams included."""
    server = RedisServer(port=free_port()).start()
    settings = Settings(redis_url=server.url, max_queued_jobs=None, retry_after_s=2, request_timeout_s=1.0,
                        sse_keepalive_s=0.1)
    try:
        with serve_api(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
            before = http.post("/v1/jobs", json={"prompt": "x"})
            assert before.status_code == 202
            server.stop(remove_dir=False)
            away = [http.post("/v1/jobs", json={"prompt": "x"}), http.get(f"/v1/jobs/{before.json()['id']}"),
                    http.get("/v1/models"), http.post("/v1/chat/completions", json={**CHAT, "stream": True})]
            for response in away:
                assert assert_openai_error(response, 503, None)["code"] == "redis_unavailable"
                assert response.headers["retry-after"] == "2"
            assert http.get("/health").status_code == 503
            server.start()  # (the same port)
            assert http.post("/v1/jobs", json={"prompt": "x"}).status_code == 202
            assert http.get("/v1/models").status_code == 200
            with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as stream:
                assert stream.status_code == 200
                lines = list(stream.iter_lines())
            assert ": keepalive" in lines and "no end of the job within 1.0 s" in "".join(lines)  # relayed, then timed out
            assert [line for line in lines if line][-1] == "data: [DONE]"
    finally:
        server.stop()


def test_ping_version_request_ids_and_cors(bare: httpx.Client, redis_server: RedisServer, serve_api) -> None:
    """vLLM's /ping answers as /health does (SageMaker's probe, GET or POST); /version is the
    installed genq's; every response names its request (the client's X-Request-Id, else a new
    one); browsers may call from any origin unless GENQ_ALLOWED_ORIGINS narrows it."""
    assert bare.get("/ping").status_code == bare.post("/ping").status_code == bare.get("/health").status_code == 503
    assert bare.get("/version").json() == {"version": version("genq")}
    assert bare.get("/health", headers={"X-Request-Id": "abc-1"}).headers["x-request-id"] == "abc-1"
    first, second = (bare.get("/v1/jobs/nope").headers["x-request-id"] for _ in range(2))
    assert len(first) == 32 and first != second
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = bare.options("/v1/chat/completions", headers=preflight)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "*"
    with serve_api(Settings(redis_url=redis_server.url, allowed_origins=("https://app.example",))) as url:
        with httpx.Client(base_url=url) as http:
            assert http.options("/v1/models", headers=preflight).headers["access-control-allow-origin"] == "https://app.example"
            other = {**preflight, "Origin": "https://elsewhere.example"}
            assert "access-control-allow-origin" not in http.options("/v1/models", headers=other).headers


def test_an_idle_stream_is_kept_alive(redis_server: RedisServer, serve_api) -> None:
    """No worker: the jobs wait in the queue, and their streams send SSE comments while they do,
    which the clients skip; the streams end at the request timeout as ever."""
    settings = Settings(redis_url=redis_server.url, sse_keepalive_s=0.1, request_timeout_s=1.0)
    with serve_api(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        job_id = http.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
        with http.stream("GET", f"/v1/jobs/{job_id}/events") as events:
            lines = list(events.iter_lines())
        assert lines.count(": keepalive") >= 3 and not [line for line in lines if line.startswith("data:")]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(model="genq", messages=[{"role": "user", "content": "hi"}], stream=True)
        with pytest.raises(openai.APIError, match="no end of the job within 1.0 s"):
            list(stream)


def test_settings_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENQ_API_KEYS", " a, b ,,")
    monkeypatch.setenv("GENQ_MAX_QUEUED_JOBS", "")
    monkeypatch.setenv("GENQ_PREFIX", "x:")
    monkeypatch.setenv("GENQ_ALLOWED_ORIGINS", "https://a.example, https://b.example")
    monkeypatch.setenv("GENQ_DEFAULT_CHAT_TEMPLATE_KWARGS", '{"enable_thinking": false}')
    settings = Settings()
    assert settings.api_keys == ("a", "b")
    assert settings.allowed_origins == ("https://a.example", "https://b.example")
    assert settings.default_chat_template_kwargs == {"enable_thinking": False}
    assert settings.max_queued_jobs is None
    assert settings.prefix == "x:"


def test_the_api_never_imports_torch_or_worker() -> None:
    code = (
        "import sys, api.main, api.cli.serve, producer.stack; api.main.create_app(); "
        "bad = [m for m in ('torch', 'worker', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
