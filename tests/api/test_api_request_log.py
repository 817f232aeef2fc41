"""GENQ_LOG_REQUESTS (api.request_log) against a live stack, through the official `openai`
client: a JSON line per request with what an operator follows a complaint by, the counts the
client was given, and never a prompt or an output."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from api.deps import key_id
from api.settings import Settings

KEY = "sk-logged"
PROMPT = "Logged words, not written down"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))


@pytest.fixture(scope="module")
def logged(live_worker: str, serve_api) -> Iterator[tuple[str, Lines]]:
    lines = Lines()
    logger = logging.getLogger("genq.requests")
    logger.addHandler(lines)
    try:
        with serve_api(Settings(redis_url=live_worker, api_keys=(KEY,), log_requests=True)) as url:
            yield url, lines
    finally:
        logger.removeHandler(lines)


def test_each_request_is_a_line_with_its_jobs_tokens_and_outcome(logged, served_model: str,
                                                                  poll: Callable[..., Any]) -> None:
    url, lines = logged
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    stream = client.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": PROMPT}], max_tokens=3, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_headers={"X-Request-Id": "follow-me"})
    chunks = list(stream)
    usage = chunks[-1].usage
    reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    two = client.completions.create(model=served_model, prompt=PROMPT, max_tokens=2, n=2, temperature=0.0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=served_model, prompt=PROMPT, max_tokens=-1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                      json={"model": served_model, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True,
                            "stream": True}) as gone:
        next(gone.iter_lines())  # the client leaves after the first event
    assert httpx.get(f"{url}/health").status_code == 200
    poll(lambda: len(lines.lines) >= 5, 30.0, "five lines")
    chat, completion, bad, unknown, left = lines.lines[:5]
    assert len(lines.lines) == 5  # no line for the probe
    assert chat["request_id"] == "follow-me" and chat["key"] == key_id(KEY)
    assert (chat["method"], chat["path"], chat["status"], chat["model"], chat["outcome"]) == (
        "POST", "/v1/chat/completions", 200, served_model, "completed")
    assert chat["response_id"] == chunks[0].id and len(chat["jobs"]) == 1
    assert (chat["prompt_tokens"], chat["completion_tokens"], chat["cached_tokens"]) == (
        usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens)
    assert chat["finish_reasons"] == {"length": 1}
    assert 0 <= chat["ttft_s"] <= chat["duration_s"]
    assert (completion["completion_tokens"], completion["finish_reasons"]) == (two.usage.completion_tokens, {"length": 2})
    assert (bad["status"], unknown["status"], "jobs" in bad, "key" in unknown) == (400, 401, False, False)
    assert (left["status"], left["outcome"]) == (200, "cancelled") and left["completion_tokens"] < 500
    written = json.dumps(lines.lines)
    assert PROMPT not in written and reply not in written


def test_a_background_response_has_a_line_for_its_end(logged, served_model: str, poll: Callable[..., Any]) -> None:
    """The request's line is written when it returns, queued; its job's end is a line of its
    own, method BACKGROUND, under the same request id and key."""
    url, lines = logged
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    before = len(lines.lines)
    queued = client.responses.create(model=served_model, input=PROMPT, max_output_tokens=4, temperature=0.0,
                                     background=True, extra_headers={"X-Request-Id": "in-the-back"})
    done = poll(lambda: (r := client.responses.retrieve(queued.id)).status == "incomplete" and r, 60.0,
                "the response, cut at max_output_tokens")
    ended = poll(lambda: next((line for line in lines.lines[before:] if line["method"] == "BACKGROUND"), None),
                 30.0, "the line of its end")
    asked = lines.lines[before]  # (then the polls' lines, its end's among them)
    assert (asked["method"], asked["status"], asked["request_id"]) == ("POST", 200, "in-the-back")
    assert (ended["method"], ended["path"], ended["request_id"], ended["key"]) == (
        "BACKGROUND", "/v1/responses", "in-the-back", key_id(KEY))
    assert (ended["response_id"], ended["outcome"], ended["finish_reasons"], ended["completion_tokens"]) == (
        asked["response_id"], "completed", {"length": 1}, done.usage.output_tokens)
    assert ended["jobs"] == asked["jobs"] and len(asked["jobs"]) == 1
    assert "status" not in ended and ended["duration_s"] > 0
