"""async_scheduling (vLLM's): a step's outputs are made while the next step runs, and come
out of that step. Whatever the requests ask (stop strings, n > 1 with seeds, logprobs and
prompt logprobs, stop token ids, min_tokens, preemptions, aborts), what each request outputs
equals the engine's without it, guided ones too (their masks filled beside the next step)."""

from __future__ import annotations

from typing import Any

import pytest
from test_logits_processors import FailsAfter  # tests/worker, beside this file

from worker import LLM, SamplingParams

PROMPTS = [[5 + i, 17, 29 + 3 * i, 41, 8] * (1 + i % 3) for i in range(10)]


def workload(stop: str, stop_id: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=2),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=30, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=20, guided_decoding={"regex": r"[a-z]{2,6}( [a-z]{2,6}){1,5}"}),
        SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=20, guided_decoding={"json_object": True}),
    ]


def outputs_of(llm: LLM, params: list[SamplingParams]) -> list[Any]:
    results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(r.request_id and r.prompt_token_ids, r.prompt_logprobs and [e and e.token_id for e in r.prompt_logprobs],
             [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
               c.logprobs and [(e.token_id, round(e.logprob, 4), sorted(e.top_logprobs)) for e in c.logprobs])
              for c in r.outputs]) for r in results]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.mark.parametrize(("num_blocks", "speculative_config"), [(256, None), (10, None), (256, NGRAM)],
                         ids=["roomy", "preempting", "guessing"])
def test_outputs_equal_the_engines_without_it(tiny_llama_dir, default_model_dir, num_blocks: int,
                                              speculative_config) -> None:
    # (guesses want a model that repeats itself: the default one, whose replies an n-gram finds)
    model = str(tiny_llama_dir) if speculative_config is None else None
    engines = {mode: LLM(model, dtype="float32", num_gpu_blocks_override=num_blocks, max_model_len=96,
                         speculative_config=speculative_config, async_scheduling=mode)
               for mode in (False, True)}
    # a stop string and a stop token id that the greedy outputs reach midway
    [plain] = engines[False].generate([{"prompt_token_ids": PROMPTS[1]}],
                                      SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    text, ids = plain.outputs[0].text, plain.outputs[0].token_ids
    stop = text[len(text) // 3 : len(text) // 3 + 2].strip() or text[-2:]
    params = workload(stop, ids[len(ids) // 2])
    synced, overlapped = (outputs_of(engines[mode], params) for mode in (False, True))
    assert overlapped == synced
    assert any(c[3] == "stop" and c[4] == stop for r in synced for c in r[2])  # (the stop string was met)
    if num_blocks == 10:
        assert engines[True].engine.scheduler.num_preemptions > 0
    if speculative_config is not None:
        assert engines[True].engine.speculator.stats.num_draft_tokens > 0


def test_a_steps_outputs_come_out_of_the_next_and_an_abort_ends_once(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, async_scheduling=True)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0.0, max_tokens=5))
    engine.add_request("b", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(temperature=0.0, max_tokens=50,
                                                                          ignore_eos=True))
    assert engine.step() == []  # (the prefill's first tokens come out of the next step)
    assert {o.request_id for o in engine.step()} == {"a", "b"}
    engine.abort_request("b")
    finals: dict[str, list[str | None]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            finals.setdefault(output.request_id, []).extend(c.finish_reason for c in output.outputs if output.finished)
    assert finals["b"] == ["abort"]
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == 64


def test_a_failure_is_told_with_its_requests_final_output(tiny_llama_dir) -> None:
    """What the queue's engine thread relies on: a request a step fails on is named by
    take_failures after the step its final output comes out of, not before (the worker fails
    the job with why, and leaves its abort output out)."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, logits_processors=[FailsAfter],
              async_scheduling=True)
    engine = llm.engine
    engine.add_request("f", {"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0.0, max_tokens=10, extra_args={"fail_after": 2}))
    told: list[tuple[set[str], set[str]]] = []  # per step: the requests whose outputs came, the failures told
    while engine.has_unfinished_requests():
        finished = {o.request_id for o in engine.step() if o.finished}
        told.append((finished, set(engine.take_failures())))
    assert [step for step in told if step != (set(), set())] == [({"f"}, {"f"})]
