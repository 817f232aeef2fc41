"""A worker with speculative decoding (GENQ_SPECULATIVE_CONFIG) on the default model, which
copies repetitive text so guesses are kept: an event may carry several tokens, and the job's
result and stream equal the offline engine's plain decoding."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

import pytest
import redis
from queue_support import WorkerProcess, wait_for

from producer.client import Client
from producer.protocol import JobStatus
from producer.redis_server import free_port
from producer.sampling_params import SamplingParams

NAME = "qs1"
TIMEOUT_S = 60.0
PROMPT = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(spawn: Callable[..., WorkerProcess], conn: redis.Redis, default_model_dir, metrics_port: int) -> WorkerProcess:
    proc = spawn(NAME, GENQ_MODEL="", GENQ_SPECULATIVE_CONFIG='{"method": "ngram", "num_speculative_tokens": 4}',
                 GENQ_METRICS_PORT=str(metrics_port), GENQ_METRICS_HOST="127.0.0.1",
                 GENQ_STREAM_INTERVAL_MS="0")  # one event a step: several tokens in one are a step's kept guesses
    proc.wait_ready(conn)
    return proc


def test_jobs_stream_several_tokens_per_event_and_match_plain_decoding(client: Client) -> None:
    from worker import LLM

    params = SamplingParams(temperature=0.0, max_tokens=48, stop=[", 9"])
    expected = LLM(None, dtype="float32", num_gpu_blocks_override=256, max_model_len=1024).generate(
        PROMPT, params, use_tqdm=False)[0].outputs[0]
    handle = client.submit(PROMPT, params)
    result = handle.result(TIMEOUT_S)
    assert result.status == JobStatus.FINISHED
    (output,) = result.outputs
    assert (output.text, output.token_ids, output.finish_reason) == (expected.text, expected.token_ids, expected.finish_reason)
    deltas = list(handle.stream(TIMEOUT_S))
    assert "".join(d.text for d in deltas) == output.text
    assert [t for d in deltas for t in d.token_ids] == output.token_ids
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    assert max(len(d.token_ids) for d in deltas) > 1  # kept guesses arrive together
    assert result.usage is not None and result.usage["completion_tokens"] == len(output.token_ids)


def test_metrics_count_guesses(client: Client, metrics_port: int) -> None:
    client.submit(PROMPT, SamplingParams(temperature=0.0, max_tokens=24)).result(TIMEOUT_S)

    def counts() -> dict[str, float] | None:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("genq:spec_decode_num_")}
        return values if values.get("genq:spec_decode_num_accepted_tokens_total") else None

    values = wait_for(counts, TIMEOUT_S, "speculative counters")
    assert 0 < values["genq:spec_decode_num_accepted_tokens_total"] <= values["genq:spec_decode_num_draft_tokens_total"]
