"""The per-step trace (producer.trace_log) of a live stack: a worker started with --trace-dir and
an API with Settings.trace_dir write a line per engine step, per publish and per event written
to a streaming client, and those lines join with what the client saw (each text chunk has its
relay line, each relay line the publish and the step it came from)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from api.settings import Settings
from worker.benchmarks.itl_trace import CAUSES, Trace, attribute, read_trace

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("step-trace")


@pytest.fixture(scope="module")
def traced_worker(stack_redis, run_worker, tiny_llama_dir: Path, tmp_path_factory, trace_dir: Path) -> Iterator[str]:
    with run_worker(stack_redis.url, tiny_llama_dir, tmp_path_factory.mktemp("traced-worker"),
                    ("--trace-dir", str(trace_dir))) as url:
        yield url


def test_a_streamed_completion_leaves_its_steps_publishes_and_relays_in_the_trace(
    traced_worker: str, serve_api, served_model: str, trace_dir: Path, poll: Callable[..., Any]
) -> None:
    with serve_api(Settings(redis_url=traced_worker, request_timeout_s=60.0, trace_dir=str(trace_dir))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        chunks, job, prompt_tokens = [], None, None
        for chunk in client.completions.create(model=served_model, prompt="Trace every step of this.",
                                               max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
                                               stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].text:
                chunks.append(time.time())
                job = chunk.id.removeprefix("cmpl-")
            if chunk.usage is not None:
                prompt_tokens = chunk.usage.prompt_tokens
    assert sorted(p.name.split("-")[0] for p in trace_dir.glob("*.jsonl")) == ["api", "worker"]

    def joined() -> Trace | None:  # (the worker writes a publish's line once its call returned: maybe after the relay)
        trace = read_trace(trace_dir)
        published = {t for p in trace.publishes for t in p["steps"]}
        return trace if all(r["step_time"] in published for r in trace.relays) else None

    trace = poll(joined, 10.0, "a publish line for every relayed event")
    assert trace.steps[0]["prefill_tokens"] == prompt_tokens and trace.steps[0]["decodes"] == 0
    assert sum(s["decodes"] for s in trace.steps) == MAX_TOKENS - 1  # (the first token came from the prefill)
    assert all(s["start"] < s["end"] and s["ms"] > 0 and s["running"] + s["waiting"] <= 1 for s in trace.steps)
    assert all(s["prefill_budget"] is not None for s in trace.steps)  # (a serving worker's step-time target)
    relays = [r for r in trace.relays if r["job"] == job]
    assert [r["seq"] for r in relays] == sorted(r["seq"] for r in relays)
    assert sum(r["tokens"] for r in relays) == MAX_TOKENS
    published = {t: p for p in trace.publishes for t in p["steps"]}
    step_ends = [s["end"] for s in trace.steps]
    for relay in relays:  # each event names the step it came from, published before it was written
        publish = published[relay["step_time"]]
        assert relay["step_time"] <= publish["called"] <= relay["written"]  # (Redis sends it during the call)
        assert min(step_ends) <= relay["step_time"]
    assert len([r for r in relays if r["text"]]) == len(chunks)
    gaps, _ = attribute([{"job": job, "chunks": chunks}], trace, threshold_s=0.0)
    assert len(gaps) == len(chunks) - 1 and all(g.cause in CAUSES for g in gaps)
