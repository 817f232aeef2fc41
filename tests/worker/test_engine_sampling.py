"""Sampling features end to end through the engine: n > 1, logprobs, prompt logprobs, seeds,
stop strings and tokens, resumed requests; and SamplingParams validation."""

from __future__ import annotations

import json
import math
import re
import shutil

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from producer.sampling_params import SamplingParams, StructuredOutputsParams
from worker import LLM
from worker.core.engine import _keep_matching, _row_outputs
from worker.core.request import Request
from worker.sample.sampler import SamplerOutput, TokenLogprobs


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=256)


def run_to_end(engine):
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done.setdefault(out.request_id, []).append(out)
    return done


def test_n_completions_share_prompt_blocks(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    out = llm.generate("The weather today is" * 5, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different draws
    again = llm.generate("The weather today is" * 5, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_n_completions_fork_blocks_by_reference(llm, tiny_llama_dir):
    engine = llm.engine
    prompt = "one two three four five six seven eight nine ten eleven twelve " * 3
    engine.add_request("fork", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=30, ignore_eos=True))
    early = engine.step()  # prompt computed by the first completion; siblings fork its blocks
    early += engine.step()
    tables = [engine.block_manager.block_table(f"fork#{i}") for i in range(3)]
    shared = tables[0][0]
    assert all(t and t[0] == shared for t in tables)
    assert engine.block_manager.pool.ref_cnt[shared] == 3
    outs = run_to_end(engine)["fork"]
    assert outs[-1].finished
    # the siblings computed the prompt's tail after the shared blocks (attended as a bucket):
    # each greedy completion is transformers' (steps report each completion's new tokens)
    tokens: dict[int, list[int]] = {}
    for out in [*early, *outs]:
        for c in out.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.tensor([llm.get_tokenizer().encode(prompt)])
    with torch.inference_mode():
        expected = hf.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert list(tokens.values()) == [expected[0, ids.shape[1]:].tolist()] * 3


def test_logprobs_match_log_softmax_of_the_model(llm, tiny_llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, ignore_eos=True)
    out = llm.generate("Hello world", params, use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = out.prompt_token_ids + comp.token_ids
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    for step, entry in enumerate(comp.logprobs):
        row = ref[len(out.prompt_token_ids) - 1 + step]
        assert entry.token_id == comp.token_ids[step] and entry.rank == 1
        assert math.isclose(entry.logprob, float(row[entry.token_id]), abs_tol=1e-4)
        top = row.topk(5)
        assert list(entry.top_logprobs) == top.indices.tolist()
        assert all(math.isclose(v, float(r), abs_tol=1e-4) for v, r in zip(entry.top_logprobs.values(), top.values, strict=True))
        tok = llm.get_tokenizer()
        assert entry.decoded == {i: tok.decode([i]) for i in [entry.token_id, *entry.top_logprobs]}


class CountUp:
    """Test logits processor: each step's token may only be 100 + the tokens before it."""

    def __init__(self, config) -> None:
        pass

    def new_req_logits_processor(self, params):
        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            forced = torch.full_like(logits, float("-inf"))
            forced[100 + len(output_ids)] = 0.0
            return forced

        return force if (params.extra_args or {}).get("count_up") else None


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits"])
def test_logprobs_mode_reports_the_logits_it_names(tiny_llama_dir, mode):
    """vLLM's logprobs_mode: the model's own logits (raw: before a custom logits processor,
    here one that forces each token, the penalty and the temperature) or those after the
    penalty and the temperature (processed), as logprobs or as values."""
    raw = mode.startswith("raw")
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, logprobs_mode=mode,
              logits_processors=[CountUp])
    params = SamplingParams(temperature=2.0, repetition_penalty=1.5, max_tokens=6, logprobs=3, ignore_eos=True,
                            seed=1, extra_args={"count_up": True} if raw else None)
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 5, 6, 7]}, params, use_tqdm=False)[0]
    comp, prompt = out.outputs[0], out.prompt_token_ids
    if raw:
        assert comp.token_ids == list(range(100, 106))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        model = hf(torch.tensor([prompt + comp.token_ids])).logits[0, len(prompt) - 1 : -1]
    for step, entry in enumerate(comp.logprobs):
        row = model[step].clone()
        if not raw:  # the penalty on the tokens seen, then the temperature
            seen = list(set(prompt + comp.token_ids[:step]))
            row[seen] = torch.where(row[seen] > 0, row[seen] / 1.5, row[seen] * 1.5)
            row = row / 2.0
        expected = row if mode.endswith("logits") else row.log_softmax(-1)
        assert math.isclose(entry.logprob, float(expected[entry.token_id]), rel_tol=1e-4, abs_tol=1e-4)
        assert list(entry.top_logprobs) == expected.topk(3).indices.tolist()


def test_prompt_logprobs_match_the_model_with_chunking(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=16)
    prompt = "A long prompt that needs several chunks of sixteen tokens to compute. " * 3
    params = SamplingParams(temperature=0.0, max_tokens=2, n=2, prompt_logprobs=3)  # a sibling recomputes the tail
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert len(ids) > 32 and len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert entry.token_id == ids[pos]
        assert math.isclose(entry.logprob, float(ref[pos - 1, ids[pos]]), abs_tol=1e-4)
        assert len(entry.top_logprobs) == 3
        assert entry.decoded[ids[pos]] == llm.get_tokenizer().decode([ids[pos]])
        assert set(entry.decoded) == {ids[pos], *entry.top_logprobs}


def test_seeded_requests_ignore_their_neighbours(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    alone = llm.generate("Seeded prompt", seeded, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate(["noise one", "Seeded prompt", "more noise here"], [other, seeded, other],
                           use_tqdm=False)[1].outputs[0].token_ids
    reordered = llm.generate(["Seeded prompt", "x y z"], [seeded, other], use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched == reordered


def test_a_batch_whose_requests_change_samples_each_by_its_own_parameters(llm):
    """The engine reuses a step's sampling batch for the next step with the same requests: one
    that ended and one that joined in its place (the same number of rows) get a batch of their own."""
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    seeded = [SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True) for seed in (7, 8)]
    alone = [llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
             for prompt, params in (("first", greedy), ("second", seeded[0]), ("third", seeded[1]))]
    engine = llm.engine
    engine.add_request("first", "first", greedy)
    engine.add_request("second", "second", seeded[0])
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.request_id == "first" and out.finished:  # the third takes its row: two rows again
                engine.add_request("third", "third", seeded[1])
    assert [outputs["first"], outputs["second"], outputs["third"]] == alone


def test_stop_string_across_tokens_and_stop_token_ids(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = llm.generate("Count with me:", greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[5:12]  # a span that (almost surely) crosses token boundaries
    cut = llm.generate("Count with me:", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    kept = llm.generate("Count with me:", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                         include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]
    stop_id = full.token_ids[3]
    by_id = llm.generate("Count with me:", SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]),
                         use_tqdm=False)[0].outputs[0]
    first = full.token_ids.index(stop_id)
    assert by_id.token_ids == full.token_ids[: first + 1] and by_id.stop_reason == stop_id
    tok = llm.get_tokenizer()
    assert by_id.text == tok.decode(full.token_ids[:first], skip_special_tokens=True)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=99, max_tokens=20, ignore_eos=True),
])
def test_resumed_request_continues_the_same_output(llm, params):
    whole = llm.generate("Resume me please", params, use_tqdm=False)[0].outputs[0]
    engine = llm.engine
    engine.add_request("resumed", "Resume me please", params, resume_output_token_ids=whole.token_ids[:7])
    outs = run_to_end(engine)["resumed"]
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    text = "".join(o.outputs[0].text for o in outs)
    assert whole.token_ids[:7] + tokens == whole.token_ids
    tok = llm.get_tokenizer()
    assert tok.decode(whole.token_ids[:7], skip_special_tokens=True) + text == whole.text


@pytest.mark.parametrize("kwargs, field", [
    ({"n": 0}, "n"), ({"temperature": -0.1}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"seed": 2**64}, "seed"),
    ({"stop": [""]}, "stop"), ({"stop_token_ids": [-3]}, "stop_token_ids"), ({"temperature": float("nan")}, "temperature"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 101}}, "logit_bias"), ({"logit_bias": [5]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-3]}, "allowed_token_ids"),
    ({"guided_decoding": {"json_object": False}}, "guided_decoding"), ({"guided_decoding": {"choice": []}}, "guided_decoding"),
    ({"guided_decoding": {"regex": ""}}, "guided_decoding regex must be a non-empty string"),
    ({"guided_decoding": "json"}, "guided_decoding"),
    ({"guided_decoding": {"json_schema": 5}}, "guided_decoding json_schema must be a JSON schema"),
    ({"guided_decoding": {"json_schema": {"type": "object", "properties": {"a": {"uniqueItems": True}}}}},
     "guided_decoding json_schema: #/properties/a: uniqueItems is not supported"),
    ({"guided_decoding": {"choice": ["a", ""]}}, "guided_decoding"),
    ({"guided_decoding": {"after": "</think>"}}, "guided_decoding must be"),
    ({"guided_decoding": {"json_object": True, "after": ""}}, "guided_decoding after must be a non-empty string"),
    ({"guided_decoding": {"grammar": 7}}, "guided_decoding grammar must be a non-empty string"),
    ({"structured_outputs": {"grammar": " "}}, "structured_outputs grammar must be a non-empty string"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs must give exactly one"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs json must be a JSON schema"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs whitespace_pattern is not"),
    ({"structured_outputs": {"grammar": 'root ::= "a"', "backend": "x"}}, "unknown structured_outputs field"),
    ({"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "a"}}, "structured_outputs and guided_decoding"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(kwargs)


@pytest.mark.parametrize("guided, message", [
    ({"regex": "(a"}, "guided_decoding regex: .*position 3: The parenthesis is not closed"),
    ({"regex": "a(?=b)"}, "guided_decoding regex: .*Lookahead is not supported"),
    ({"grammar": "root ::= item"}, 'guided_decoding grammar: .*line 1, column 10: Rule "item" is not defined'),
    ({"grammar": 'start: "a" | b'}, "guided_decoding grammar: Lark error at line 1, column 14: unknown name 'b'"),
    ({"json_schema": {"type": "objekt"}}, 'guided_decoding json_schema: Unsupported type "objekt"'),
    ({"structural_tag": {"format": {"type": "nope"}}}, "guided_decoding structural_tag: .*Format type not recognized"),
])
def test_guides_xgrammar_cannot_compile_are_refused_naming_what(llm, guided, message):
    """SamplingParams checks a guide's shape; the engine compiles it (xgrammar) as the request
    is added, and refuses it naming what is wrong, leaving nothing behind."""
    params = SamplingParams(max_tokens=2, guided_decoding=guided)
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad-guide", "hello", params)
    assert "bad-guide" not in llm.engine.output_processor.parents and not llm.engine.guided.states


def test_logit_bias_and_allowed_token_ids_steer_generation(llm):
    vocab = llm.engine.model_config.vocab_size
    forced = llm.generate("Bias me", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                    logit_bias={"123": 100.0}), use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [123] * 6  # JSON's string keys are token ids too
    allowed = SamplingParams(temperature=1.0, seed=4, max_tokens=24, ignore_eos=True, allowed_token_ids=[7, 99, 512])
    assert set(llm.generate("Pick", allowed, use_tqdm=False)[0].outputs[0].token_ids) <= {7, 99, 512}
    for bad in ({"logit_bias": {vocab: 1.0}}, {"allowed_token_ids": [5, vocab]}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"prompt 1: {name} names token id {vocab}.* outside the vocabulary"):
            llm.generate(["fine", "bad"], [SamplingParams(), SamplingParams(**bad)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # the good prompt was not queued either


def test_bad_words_are_never_completed(llm, tiny_llama_dir):
    """vLLM's bad_words against transformers' bad_words_ids on the same token sequences
    (greedy): a word the free output contains is banned, its single-token and multi-token
    tokenizations alike, and the output goes the way transformers' does."""
    prompt = "Once upon a time, in a land far away,"
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free_ids = llm.generate(prompt, free, use_tqdm=False)[0].outputs[0].token_ids
    tokenizer = llm.get_tokenizer()
    words = [tokenizer.decode(free_ids[4:6]).strip(), tokenizer.decode(free_ids[10:11]).strip()]
    words = [w for w in words if w]
    banned = llm.engine.inputs.bad_words_token_ids(words)
    prompt_ids = tokenizer.encode(prompt)
    assert not any(prompt_ids[len(prompt_ids) - len(s) + 1:] == s[:-1] for s in banned if len(s) > 1)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words=words),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert out != free_ids
    for seq in banned:
        assert not any(out[i : i + len(seq)] == seq for i in range(len(out)))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                             bad_words_ids=banned)[0, len(prompt_ids):].tolist()
    assert out == ref
    with pytest.raises(ValueError, match="bad_words must be a list of non-empty strings"):
        SamplingParams(bad_words=["ok", " "])


def test_beam_search_matches_transformers(llm, tiny_llama_dir):
    """LLM.beam_search against transformers' beam search on the same tokens, several prompts
    at once, with the end of sequence off on both sides: the same beams in the same order."""
    from producer.beam_search import BeamSearchParams

    prompts = ["The old lighthouse keeper", "In the morning we"]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokenizer = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), num_beams=3, num_return_sequences=3, do_sample=False,
                                 max_new_tokens=6, pad_token_id=0)
        assert [s.token_ids for s in out.sequences] == [row[len(ids):].tolist() for row in ref]
        assert [s.cum_logprob for s in out.sequences] == sorted((s.cum_logprob for s in out.sequences), reverse=True)
        assert all(s.finish_reason == "length" and s.text == tokenizer.decode(s.token_ids) for s in out.sequences)
    with pytest.raises(ValueError, match="beam_width must be an integer in"):
        BeamSearchParams(beam_width=11, max_tokens=4)


def test_guided_choice_outputs_one_of_the_choices(llm):
    # 日 and 🙂 exist in the vocabulary only as byte pieces that decode to U+FFFD alone
    choices = ["yes", "no", "not sure", "maybe later", "日本", "🙂 café"]
    params = SamplingParams(temperature=1.0, seed=11, n=12, max_tokens=16, guided_decoding={"choice": choices})
    out = llm.generate("Answer:", params, use_tqdm=False)[0]
    assert [(o.text in choices, o.finish_reason) for o in out.outputs] == [(True, "stop")] * 12
    assert {o.text for o in out.outputs} & {"日本", "🙂 café"}
    assert not llm.engine.guided.states  # forgotten with their requests


@pytest.mark.parametrize("pattern", [
    r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{2,6}( [A-Z][a-z]{2,6})?", r"(日本|🙂)+ ?[^\n]{0,3}",
    r"[\w.]{1,8}@[a-z]{1,6}\.(com|org)", r"-?(0|[1-9]\d{0,4})(\.\d{1,2})?",
])
def test_guided_regex_outputs_match_the_pattern(llm, pattern):
    """A random model, sampled hot: only the grammar makes its output match (Python's re,
    ASCII classes, is the oracle)."""
    params = SamplingParams(temperature=1.0, seed=3, n=8, max_tokens=24, guided_decoding={"regex": pattern})
    out = llm.generate("Say:", params, use_tqdm=False)[0]
    for o in out.outputs:
        if o.finish_reason == "stop":
            assert re.fullmatch(pattern, o.text, re.ASCII), o.text
        else:  # max_tokens came first: what there is must still begin a match
            assert o.finish_reason == "length" and len(o.token_ids) == 24
    assert sum(o.finish_reason == "stop" for o in out.outputs) >= 6


def test_guided_grammar_outputs_are_sentences_of_it(llm):
    """vLLM's structured_outputs grammar (EBNF): a random model sampled hot writes only what
    the grammar allows, as xgrammar (vLLM's backend for it) judges."""
    import xgrammar as xgr

    grammar = r"""
root ::= "SELECT " columns " FROM " table (" WHERE " condition)? ";"
columns ::= "*" | column (", " column){0,3}
column ::= [a-z] [a-z_0-9]{0,6} | "\"" [^"\n]{1,8} "\""
table ::= "users" | "orders" | "日本"
condition ::= column (" = " | " < ") ([0-9]+ | "'" [a-z]* "'")
"""
    params = SamplingParams(temperature=1.0, seed=4, n=8, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(grammar=grammar))
    outs = llm.generate("Query:", params, use_tqdm=False)[0].outputs
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(grammar)
    for o in outs:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(o.text.encode()), o.text
        assert matcher.is_completed() if o.finish_reason == "stop" else len(o.token_ids) == 40, o.text
    assert sum(o.finish_reason == "stop" for o in outs) >= 4


def test_jump_forward_writes_what_the_grammar_forces_in_fewer_steps(llm):
    """Without a proposer a guided request guesses the text its grammar forces next (the keys
    its schema names, the punctuation between); the model checks the guesses as any, so a
    greedy output is the one it writes without them, in fewer steps."""
    schema = {"type": "object", "required": ["colour", "brightness", "label"], "additionalProperties": False,
              "properties": {"colour": {"enum": ["red", "blue"]}, "brightness": {"type": "integer"},
                             "label": {"type": "string", "maxLength": 4}}}
    params = SamplingParams(temperature=0.0, max_tokens=60,
                            guided_decoding={"json_schema": schema, "disable_any_whitespace": True})
    engine = llm.engine

    def run(jump_forward: bool) -> tuple[list[int], int]:
        engine.speculator.jump_forward = jump_forward
        engine.add_request("jump", "Pick:", params)
        tokens, steps = [], 0
        while engine.has_unfinished_requests():
            tokens += [t for o in engine.step() for t in o.outputs[0].token_ids]
            steps += 1
        return tokens, steps

    try:
        (plain, plain_steps), (jumped, jumped_steps) = run(False), run(True)
    finally:
        engine.speculator.jump_forward = True
    assert jumped == plain and json.loads(llm.get_tokenizer().decode(plain, skip_special_tokens=True))["colour"] in ("red", "blue")
    assert jumped_steps < plain_steps, (jumped_steps, plain_steps)


def test_lark_grammar_outputs_are_sentences_of_it(llm):
    """A grammar without "::=" is Lark's (vLLM tells them apart so): a random model sampled hot
    writes only what Lark's own Earley parser accepts."""
    import lark

    grammar = r"""
start: greeting " " NAME ("," " " NAME)* "!"
greeting: "hi" | "hello"
NAME: /[A-Z][a-z]{1,5}/
"""
    params = SamplingParams(temperature=1.0, seed=4, n=8, max_tokens=40, guided_decoding={"grammar": grammar})
    outs = llm.generate("Greet:", params, use_tqdm=False)[0].outputs
    parser = lark.Lark(grammar)
    for o in outs:
        if o.finish_reason == "stop":
            parser.parse(o.text)  # (raises where Lark refuses it)
        else:
            assert len(o.token_ids) == 40, o.text
    assert sum(o.finish_reason == "stop" for o in outs) >= 4


def test_structural_tags_hold_calls_to_their_schemas_between_free_text(llm):
    """vLLM's structural_tag: sampled hot from a handful of tokens (allowed_token_ids) the
    free text writes the trigger ("<") often; from there each call must follow its begin,
    schema and end, as xgrammar judges."""
    import xgrammar as xgr

    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    spec = {"structures": [{"begin": "<t>", "schema": schema, "end": "</t>"}], "triggers": ["<"]}
    tokenizer = llm.get_tokenizer()
    pieces = ["<", "t", ">", "</", "/", "{", '"', "a", ":", "1", "2", "}", " ", "x"]
    allowed = sorted({i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False)})
    params = SamplingParams(temperature=1.0, seed=6, n=8, max_tokens=48, allowed_token_ids=allowed,
                            structured_outputs={"structural_tag": json.dumps({"type": "structural_tag", **spec})})
    outs = llm.generate("Call:", params, use_tqdm=False)[0].outputs
    item = xgr.StructuralTagItem(begin="<t>", schema=json.dumps(schema), end="</t>")
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(xgr.Grammar.from_structural_tag([item], ["<"]))
    for o in outs:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(o.text), o.text
        assert matcher.is_completed() if o.finish_reason == "stop" else len(o.token_ids) == 48, o.text
    calls = [c for o in outs for c in re.findall(r"<t>(.*?)</t>", o.text)]
    assert len(calls) >= 3 and all(isinstance(json.loads(c)["a"], int) for c in calls), calls


def test_json_schema_strings_keep_their_patterns_and_formats(llm):
    """What pydantic writes for constr(pattern=...), date, UUID and conint(ge=, le=) fields."""
    import jsonschema

    schema = {"type": "object", "required": ["sku", "day", "id", "qty"], "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{2}\\d{3}$"}, "day": {"type": "string", "format": "date"},
        "id": {"type": "string", "format": "uuid"}, "qty": {"type": "integer", "minimum": 1, "maximum": 12}}}
    params = SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=120, guided_decoding={"json_schema": schema})
    outs = llm.generate("Record:", params, use_tqdm=False)[0].outputs
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 2
    for o in finished:
        checker.validate(json.loads(o.text))


def test_guided_decoding_can_start_after_a_marker(llm):
    """As a reasoning model's answer is guided only after "</think>": the output is free (the
    same tokens as unguided) until the marker, then one of the choices."""
    free = llm.generate("Answer:", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    marker = free.outputs[0].text  # three tokens of free text, ending on a token boundary
    choices = ["yes", "no"]
    params = SamplingParams(temperature=0.0, max_tokens=16, guided_decoding={"choice": choices, "after": marker})
    out = llm.generate("Answer:", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:3] == free.outputs[0].token_ids
    assert out.text.startswith(marker) and out.text[len(marker):] in choices and out.finish_reason == "stop"


@pytest.mark.slow
def test_guided_json_object_on_the_default_model():
    llm = LLM(None, dtype="bfloat16", max_model_len=1024, num_gpu_blocks_override=128)
    messages = [{"role": "user", "content": "Describe a cat as a JSON object with the keys name and age."}]
    schema = {"type": "object", "required": ["name", "age", "colours"], "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "colours": {"type": "array", "items": {"enum": ["black", "white", "orange"]}, "maxItems": 3}}}
    params = [SamplingParams(temperature=0.0, max_tokens=8),  # one batch: unguided, then each grammar
              SamplingParams(temperature=0.0, max_tokens=80, guided_decoding={"json_object": True}),
              SamplingParams(temperature=0.0, max_tokens=80, guided_decoding={"json_schema": schema})]
    free, guided, shaped = (out.outputs[0] for out in llm.chat([messages] * 3, params, use_tqdm=False))
    assert guided.finish_reason == "stop", guided.text
    assert isinstance(json.loads(guided.text), dict)
    assert not free.text.lstrip().startswith("{")  # unguided, it writes prose first
    assert shaped.finish_reason == "stop", shaped.text
    jsonschema.validate(json.loads(shaped.text), schema)


def test_tools_reach_the_chat_template(tiny_llama_dir, tmp_path):
    model_dir = tmp_path / "with-tools"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(  # a template that shows tools, as Qwen's do
        "{% for t in tools or [] %}tool: {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    )
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64)
    tool = {"type": "function", "function": {"name": "set_colour", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "hi"}]
    assert llm.engine.inputs.apply_chat_template(messages, tools=[tool])["prompt"] == "tool: set_colour\nuser: hi\nassistant:"
    assert llm.engine.inputs.apply_chat_template(messages)["prompt"] == "user: hi\nassistant:"
    out = llm.chat(messages, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False, tools=[tool])[0]
    assert out.prompt == "tool: set_colour\nuser: hi\nassistant:"


def test_template_variables_and_continuing_the_last_message(tiny_llama_dir, tmp_path):
    model_dir = tmp_path / "thinking"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(  # a variable, as Qwen3's enable_thinking
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% if think %} <think>{% endif %}{% endif %}"
    )
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64)
    messages = [{"role": "user", "content": "hi"}]
    assert llm.engine.inputs.apply_chat_template(messages, think=True)["prompt"] == "user: hi\nassistant: <think>"
    out = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, chat_template_kwargs={"think": True})[0]
    assert out.prompt == "user: hi\nassistant: <think>"
    # continue_final_message: the prompt ends inside the last message, as transformers renders it
    tokenizer = llm.get_tokenizer()
    started = [*messages, {"role": "assistant", "content": "Once upon a"}]
    expected = tokenizer.apply_chat_template(started, tokenize=False, continue_final_message=True)
    assert expected.endswith("assistant: Once upon a")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = llm.chat(started, params, use_tqdm=False, continue_final_message=True)[0]
    direct = llm.generate(expected, params, use_tqdm=False)[0]
    assert out.prompt == expected and out.outputs[0].token_ids == direct.outputs[0].token_ids


def test_unknown_sampling_field_is_an_error():
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"temprature": 1.0})


def test_a_step_without_guesses_reads_and_keeps_rows_as_with_empty_guesses():
    """_row_outputs and _keep_matching skip their walk of the rows when no request has guesses
    (drafts empty); what they return is what the walk returns for guesses that are all empty."""
    requests = [Request(str(i), [1, 2], SamplingParams(), output_token_ids=[3] * i) for i in range(4)]
    row_ids = [r.request_id for r in requests]
    empty_guesses: dict[str, list[int]] = {rid: [] for rid in row_ids}
    outputs = _row_outputs(row_ids, requests, {})
    assert outputs == _row_outputs(row_ids, requests, empty_guesses)
    assert all(out is r.output_token_ids for out, r in zip(outputs, requests, strict=True))
    entry = TokenLogprobs(token_id=6, logprob=-0.5, rank=1, top_logprobs={6: -0.5})
    for logprobs in (None, [None, entry, None, entry]):
        out = SamplerOutput(token_ids=[5, 6, 7, 6], logprobs=logprobs)
        assert _keep_matching(row_ids, out, {}) == _keep_matching(row_ids, out, empty_guesses)
    assert _keep_matching(row_ids, out, {})[1] == {"1": [entry], "3": [entry]}
