"""Responses built from events (shapes, failure statuses), for inputs the live tests cannot
easily produce."""

from __future__ import annotations

from api.generate import Collector
from api.logprobs import completion_logprobs, prompt_logprobs, vllm_prompt_logprobs
from api.render import RelayedRequest
from producer.protocol import ERROR_INVALID_REQUEST, Event

GENQ_PROMPT = [
    {"token_id": 1, "token": "<s>"},
    {"token_id": 7, "token": "Hi", "logprob": -2.0, "rank": 3, "top_logprobs": {9: -0.5, 4: -1.0},
     "decoded": {7: "Hi", 9: "Yo", 4: "Ah"}},
]


def test_vllm_prompt_logprobs_name_the_token_and_its_alternatives() -> None:
    assert vllm_prompt_logprobs(GENQ_PROMPT) == [None, {
        "9": {"logprob": -0.5, "rank": 1, "decoded_token": "Yo"},
        "4": {"logprob": -1.0, "rank": 2, "decoded_token": "Ah"},
        "7": {"logprob": -2.0, "rank": 3, "decoded_token": "Hi"},
    }]
    assert vllm_prompt_logprobs(None) is None


def test_entries_in_another_form_show_nothing_instead_of_failing() -> None:
    assert vllm_prompt_logprobs([None, {"7": -1.0}, "junk"]) == [None, None, None]
    assert [lp.logprob for lp in prompt_logprobs([None, {"logprob": float("-inf")}])] == [None, -9999.0]


def test_the_echoed_first_token_has_null_logprob_and_alternatives() -> None:
    body = completion_logprobs(prompt_logprobs(GENQ_PROMPT), [0, 3], k=1)
    assert body == {
        "tokens": ["<s>", "Hi"], "token_logprobs": [None, -2.0],
        "top_logprobs": [None, {"Yo": -0.5, "Hi": -2.0}], "text_offset": [0, 3],
    }


def test_a_failed_job_is_the_requests_fault_only_when_the_worker_says_so() -> None:
    req = RelayedRequest(id="cmpl-x", job_ids=["j"], n=1, model="m", created=0)
    for error_type, expected in (
        (ERROR_INVALID_REQUEST, (400, "invalid_request_error", "invalid_request")),
        (None, (500, "server_error", "job_failed")),  # a worker crash loop, a lost entry, ...
    ):
        collector = Collector(req)
        collector.add("j", Event(seq=0, error="boom", error_type=error_type))
        assert collector.error == "job j failed: boom" and collector.error_kind() == expected
