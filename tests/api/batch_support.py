"""Helpers for the batch API tests: request lines, running a batch, reading its files."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import openai

TERMINAL = ("completed", "failed", "cancelled", "expired")
BATCH_TIMEOUT_S = 120.0
MESSAGES = [{"role": "user", "content": "Say something."}]


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(custom_id: str, model: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": MESSAGES, "temperature": 0.0, "max_tokens": 6,
                     "ignore_eos": True, **body}}


def run_batch(oai: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str = "/v1/chat/completions"):
    uploaded = oai.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    return oai.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")


def wait_done(oai: openai.OpenAI, batch_id: str, poll: Callable[..., Any]):
    return poll(lambda: (b := oai.batches.retrieve(batch_id)).status in TERMINAL and b, BATCH_TIMEOUT_S, "batch end")


def read_file(oai: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    """A batch's output or error file, by custom_id."""
    if file_id is None:
        return {}
    return {(o := json.loads(line))["custom_id"]: o for line in oai.files.content(file_id).text.splitlines()}
