"""The batch API against a live stack (Redis, a real worker on the tiny Llama, uvicorn), driven
by the official `openai` client: upload a file of requests, run it, read the output and error
files; a file that does not check out. (Runners with their own settings: test_api_batch_runner.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest
from batch_support import chat_line, read_file, run_batch, wait_done
from openai.types.chat import ChatCompletion

from api.batches import BATCH_PRIORITY
from producer.client import Client


def test_a_batch_runs_its_requests_and_answers_each_as_the_endpoint_would(
    served_model: str, oai: openai.OpenAI, live_worker: str, poll: Callable[..., Any]
) -> None:
    lines = [
        chat_line("plain", served_model),
        chat_line("two", served_model, n=2, temperature=1.0, seed=5),
        chat_line("logprobs", served_model, logprobs=True, top_logprobs=2),
        chat_line("bad-token", served_model, logit_bias={"10000000": 1}),  # the worker refuses it
    ]
    batch = run_batch(oai, lines)
    assert (batch.status, batch.request_counts.total, batch.endpoint) == ("in_progress", 4, "/v1/chat/completions")
    done = wait_done(oai, batch.id, poll)
    assert done.status == "completed" and done.completed_at is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)
    outputs, errors = read_file(oai, done.output_file_id), read_file(oai, done.error_file_id)
    assert set(outputs) == {"plain", "two", "logprobs"} and set(errors) == {"bad-token"}
    for line in lines[:3]:  # the same request sent directly: the same tokens (greedy or seeded)
        direct = oai.post("/chat/completions", body=line["body"], cast_to=ChatCompletion)
        response = outputs[line["custom_id"]]["response"]
        body = response["body"]
        assert response["status_code"] == 200 and body["object"] == "chat.completion"
        assert [c["message"]["content"] for c in body["choices"]] == [c.message.content for c in direct.choices]
        assert body["usage"]["completion_tokens"] == direct.usage.completion_tokens
    assert len(outputs["logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]) == 6
    error = errors["bad-token"]["response"]
    assert error["status_code"] == 400 and "outside the vocabulary" in error["body"]["error"]["message"]
    assert done.id in [b.id for b in oai.batches.list()]
    with Client(live_worker) as client:  # batch requests queue behind the API's own
        job = client.inspect(f"{done.id}-0")["job"]
    assert (job["priority"], job["id"]) == (BATCH_PRIORITY, f"{done.id}-0")


def test_completions_batches_and_the_files_api(served_model: str, oai: openai.OpenAI, poll: Callable[..., Any]) -> None:
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": served_model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}}
             for i, prompt in enumerate(["Once upon", ["a", "b"]])]
    done = wait_done(oai, run_batch(oai, lines, "/v1/completions").id, poll)
    outputs = read_file(oai, done.output_file_id)
    assert done.status == "completed" and done.error_file_id is None
    assert [len(outputs[f"c{i}"]["response"]["body"]["choices"]) for i in range(2)] == [1, 2]  # one per prompt
    direct = oai.completions.create(**lines[0]["body"])
    assert outputs["c0"]["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
    # the files: listed, read, deleted
    output_file = oai.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output" and output_file.bytes == len(oai.files.content(output_file.id).content)
    assert output_file.id in [f.id for f in oai.files.list(purpose="batch_output")]
    paged = [f.id for f in oai.files.list(purpose="batch", limit=1)]  # the client follows `after`
    assert len(paged) == len(set(paged)) >= 2 and done.input_file_id in paged
    assert oai.files.delete(output_file.id).deleted
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(output_file.id)
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        oai.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")


def test_a_responses_batch(served_model: str, oai: openai.OpenAI, poll: Callable[..., Any]) -> None:
    body = {"model": served_model, "input": "Say something.", "max_output_tokens": 5, "temperature": 0.0}
    lines = [{"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": body},
             {"custom_id": "bad", "method": "POST", "url": "/v1/responses", "body": {**body, "previous_response_id": "x"}}]
    failed = run_batch(oai, lines, "/v1/responses")  # checked as the endpoint checks it
    assert [(e.line, e.param) for e in failed.errors.data] == [(2, "previous_response_id")]
    done = wait_done(oai, run_batch(oai, lines[:1], "/v1/responses").id, poll)
    response = read_file(oai, done.output_file_id)["r"]["response"]["body"]
    direct = oai.responses.create(**body)
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert response["output"][0]["content"][0]["text"] == direct.output_text


def test_an_embeddings_batch(served_model: str, oai: openai.OpenAI, api_url: str, poll: Callable[..., Any]) -> None:
    """Embedding lines run as embedding jobs; each output is what /v1/embeddings answers."""
    import base64
    import struct

    import httpx

    bodies = {"one": {"model": served_model, "input": "A corpus line"},
              "two": {"model": served_model, "input": ["first", "second"], "encoding_format": "base64"},
              "bad": {"model": served_model, "input": [[1, 10_000_000]]}}
    lines = [{"custom_id": k, "method": "POST", "url": "/v1/embeddings", "body": b} for k, b in bodies.items()]
    assert [(e.line, e.param) for e in run_batch(oai, [*lines, {**lines[0], "custom_id": "empty", "body": {"input": ""}}],
                                                 "/v1/embeddings").errors.data] == [(4, "input")]
    done = wait_done(oai, run_batch(oai, lines, "/v1/embeddings").id, poll)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 2, 1)
    outputs, errors = read_file(oai, done.output_file_id), read_file(oai, done.error_file_id)
    for custom_id in ("one", "two"):
        body = outputs[custom_id]["response"]["body"]
        direct = httpx.post(f"{api_url}/v1/embeddings", json={**bodies[custom_id], "encoding_format": "float"},
                            timeout=60).json()
        assert body["object"] == "list" and body["usage"] == direct["usage"]
        for got, want in zip(body["data"], direct["data"], strict=True):
            vector = got["embedding"]
            if isinstance(vector, str):  # base64, as the line asked
                raw = base64.b64decode(vector)
                vector = list(struct.unpack(f"<{len(raw) // 4}f", raw))
            assert vector == pytest.approx(want["embedding"], abs=1e-5)
    assert errors["bad"]["response"]["status_code"] == 400


def test_a_file_that_does_not_check_out_fails_the_batch_naming_its_lines(served_model: str, oai: openai.OpenAI) -> None:
    good = chat_line("a", served_model)
    lines = [good, {**good, "url": "/v1/completions"}, good, chat_line("b", served_model, temperature=-1)]
    batch = run_batch(oai, lines)
    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "mismatched_url"), (3, "duplicate_custom_id"), (4, "invalid_value")]
    assert batch.errors.data[2].param == "temperature"
    uploaded = oai.files.create(file=("bad.jsonl", b"not json\n"), purpose="batch")
    broken = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert [(e.line, e.code) for e in broken.errors.data] == [(1, "invalid_json")]
    with pytest.raises(openai.NotFoundError):
        oai.batches.create(input_file_id="file-none", endpoint="/v1/chat/completions", completion_window="24h")
