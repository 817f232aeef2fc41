"""Job endpoints against a live stack: submit (202), poll, SSE events with resume from
Last-Event-ID, cancel."""

from __future__ import annotations

import json

import httpx

CHAT_JOB = {"kind": "chat", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 10, "temperature": 0.0, "ignore_eos": True}


def sse_events(http: httpx.Client, job_id: str, last_event_id: str | None = None) -> list[dict]:
    """Every SSE event of the job's stream (until [DONE]) as {"id", "data"}."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    events, current = [], {}
    with http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("id: "):
                current["id"] = line[4:]
            elif line == "data: [DONE]":
                return events
            elif line.startswith("data: "):
                current["data"] = json.loads(line[6:])
            elif not line and current:
                events.append(current)
                current = {}
    raise AssertionError("stream ended without [DONE]")


def test_submit_then_poll_until_finished(http: httpx.Client, poll) -> None:
    response = http.post("/v1/jobs", json=CHAT_JOB)
    assert response.status_code == 202
    job = response.json()
    assert job["object"] == "job" and job["status"] in ("queued", "running", "finished")
    assert response.headers["location"] == f"/v1/jobs/{job['id']}"
    view = poll(lambda: (v := http.get(f"/v1/jobs/{job['id']}").json())["status"] == "finished"
                and v)
    (output,) = view["outputs"]
    assert len(output["token_ids"]) == 10 and output["text"] and output["finish_reason"] == "length"
    assert view["usage"]["completion_tokens"] == 10 and view["worker"]


def test_a_refused_job_says_it_was_the_requests_fault(http: httpx.Client, poll) -> None:
    # (text: the API cannot count its tokens, so the worker refuses it; token ids it refuses itself)
    job_id = http.post("/v1/jobs", json={"prompt": "word " * 1100, "max_tokens": 2}).json()["id"]
    view = poll(lambda: (v := http.get(f"/v1/jobs/{job_id}").json())["status"] == "failed" and v)
    assert view["error_type"] == "invalid_request" and "max_model_len" in view["error"]
    (event,) = [e["data"] for e in sse_events(http, job_id)]
    assert event["error_type"] == "invalid_request"
    early = http.post("/v1/jobs", json={"prompt": [5] * 1100, "max_tokens": 2})
    assert early.status_code == 400 and "1102 tokens (1100 in the prompt, 2 in the completion)" in early.text
    cut = http.post("/v1/jobs", json={"prompt": [5] * 1100, "max_tokens": 2, "truncate_prompt_tokens": 1000})
    assert cut.status_code == 202  # the worker keeps its last 1000 tokens: it fits


def test_events_resume_after_last_event_id(http: httpx.Client) -> None:
    job_id = http.post("/v1/jobs", json={"prompt": "Once", "max_tokens": 8, "ignore_eos": True,
                                         "temperature": 0.0}).json()["id"]
    events = sse_events(http, job_id)
    assert [e["id"] for e in events] == [str(e["data"]["seq"]) for e in events]
    assert sum(len(e["data"]["token_ids"]) for e in events) == 8
    assert events[-1]["data"]["finished"] and events[-1]["data"]["usage"]["completion_tokens"] == 8
    for k in (0, len(events) // 2, len(events) - 1):
        assert sse_events(http, job_id, events[k]["id"]) == events[k + 1:]


def test_events_of_n_completions_have_index_seq_ids(http: httpx.Client) -> None:
    body = {**CHAT_JOB, "n": 2, "temperature": 1.0, "seed": 3}
    job_id = http.post("/v1/jobs", json=body).json()["id"]
    events = sse_events(http, job_id)
    assert {e["data"]["index"] for e in events} == {0, 1}
    assert all(e["id"] == f"{e['data']['index']}:{e['data']['seq']}" for e in events)
    middle = len(events) // 2
    assert sse_events(http, job_id, events[middle]["id"]) == events[middle + 1:]
    view = http.get(f"/v1/jobs/{job_id}").json()
    assert [o["index"] for o in view["outputs"]] == [0, 1]


def test_idempotent_job_id(http: httpx.Client) -> None:
    body = {"prompt": "Once", "max_tokens": 2, "job_id": "fixed-id-1"}
    first = http.post("/v1/jobs", json=body).json()
    again = http.post("/v1/jobs", json=body).json()
    assert first["id"] == again["id"] == "fixed-id-1"
    assert first["enqueued"] and not again["enqueued"]


def test_delete_cancels_a_running_job(http: httpx.Client, poll) -> None:
    job_id = http.post("/v1/jobs", json={**CHAT_JOB, "max_tokens": 900}).json()["id"]
    poll(lambda: http.get(f"/v1/jobs/{job_id}").json()["status"] == "running")
    response = http.delete(f"/v1/jobs/{job_id}")
    assert response.status_code == 202 and response.json()["cancel_requested"]
    view = poll(lambda: (v := http.get(f"/v1/jobs/{job_id}").json())["status"] == "cancelled" and v)
    assert view["outputs"][0]["finish_reason"] == "abort"
    assert len(view["outputs"][0]["token_ids"]) < 900
    again = http.delete(f"/v1/jobs/{job_id}")
    assert again.status_code == 200 and not again.json()["cancel_requested"]
