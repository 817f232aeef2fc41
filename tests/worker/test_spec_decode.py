"""Speculative decoding with n-gram guesses, and with a draft model's: lossless. Greedy tokens equal transformers'
exactly; with stop tokens, stop strings, max_tokens, penalties, logprobs, n > 1 and
preemption, every output equals the same engine's without speculation.

The default model runs these: it continues repetitive text by copying it, so many guesses
are right and the steps that keep several tokens are exercised (a tiny random model almost
never repeats itself)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from test_engine import hf_greedy_along

from producer.sampling_params import SamplingParams
from worker import LLM
from worker.core.request import NO_TOKEN
from worker.model_executor.models.packed_linear import can_pack
from worker.spec_decode.speculative import NgramProposer, SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
PROMPTS = [
    "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "Hello, my name is",
]


def engine(spec: bool, **kwargs) -> LLM:
    args = {"dtype": "float32", "num_gpu_blocks_override": 256, "max_model_len": 1024, **kwargs}
    return LLM(None, speculative_config=NGRAM if spec else None, **args)


@pytest.fixture(scope="module")
def plain_llm(default_model_dir) -> LLM:
    return engine(spec=False)


@pytest.fixture(scope="module")
def spec_llm(default_model_dir) -> LLM:
    return engine(spec=True)


def test_greedy_matches_transformers_and_guesses_are_kept(default_model_dir, spec_llm):
    tok = spec_llm.get_tokenizer()
    before, generated = dataclasses.replace(spec_llm.engine.speculator.stats), spec_llm.engine.num_generated_tokens
    outs = spec_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens == hf_greedy_along(default_model_dir, [tok.encode(p) for p in PROMPTS], tokens)
    stats = spec_llm.engine.speculator.stats  # since the engine started: this test's share
    accepted, drafted = stats.num_accepted_tokens - before.num_accepted_tokens, stats.num_draft_tokens - before.num_draft_tokens
    assert accepted > 28 and drafted >= accepted
    assert spec_llm.engine.num_generated_tokens - generated == 28 * len(PROMPTS)


CASES = {
    "stop token ids": SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[30, 1171]),  # "." and " mat"
    "stop strings": SamplingParams(temperature=0.0, max_tokens=24, stop=["the mat", "3, 4"]),
    "stop string kept": SamplingParams(temperature=0.0, max_tokens=24, stop=["3,"], include_stop_str_in_output=True),
    "max tokens": SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    "penalties and logprobs": SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3,
                                             frequency_penalty=0.2, logprobs=3, ignore_eos=True),
    "min tokens": SamplingParams(temperature=0.0, max_tokens=20, min_tokens=12),
    "n=2 seeded random": SamplingParams(temperature=0.8, max_tokens=20, n=2, seed=7),
}


@pytest.fixture(scope="module")
def both_outputs(plain_llm, spec_llm) -> dict[str, tuple[list, list, int | None]]:
    """Each case's outputs from both engines, and how many guesses the speculating one made for
    it. Each engine runs the cases in one batch (each prompt once per case), but for the
    speculating engine's seeded case, which runs alone so that its guesses (none) can be counted."""
    seeded = "n=2 seeded random"
    batched = [case for case in CASES if case != seeded]
    n = len(PROMPTS)

    def generate(llm: LLM, cases: list[str]) -> dict[str, list]:
        outs = llm.generate([p for _ in cases for p in PROMPTS], [CASES[c] for c in cases for _ in PROMPTS],
                            use_tqdm=False)
        return {case: outs[i * n : (i + 1) * n] for i, case in enumerate(cases)}

    plain, spec = generate(plain_llm, [*batched, seeded]), generate(spec_llm, batched)
    outputs: dict[str, tuple[list, list, int | None]] = {case: (plain[case], spec[case], None) for case in batched}
    assert spec_llm.engine.speculator.stats.num_drafts > 0
    drafts_before = spec_llm.engine.speculator.stats.num_drafts
    outputs[seeded] = (plain[seeded], generate(spec_llm, [seeded])[seeded],
                       spec_llm.engine.speculator.stats.num_drafts - drafts_before)
    return outputs


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_equal_plain_decoding(both_outputs, case):
    plain, spec, num_drafts = both_outputs[case]
    for p, s in zip(plain, spec, strict=True):
        for a, b in zip(p.outputs, s.outputs, strict=True):
            assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (a.text, a.token_ids, a.finish_reason, a.stop_reason)
            if a.logprobs is not None:
                assert [e.token_id for e in b.logprobs] == [e.token_id for e in a.logprobs]
                assert [e.logprob for e in b.logprobs] == pytest.approx([e.logprob for e in a.logprobs], abs=1e-4)
                assert [sorted(e.top_logprobs) for e in b.logprobs] == [sorted(e.top_logprobs) for e in a.logprobs]
    if num_drafts is not None:  # seeded random rows draw one noise vector per token: never guessed for
        assert num_drafts == 0


PEOPLE = r"(- name: [A-Z][a-z]{1,8}, city: [A-Z][a-z]{1,8}\n){4}"


def test_guided_requests_guess_within_their_grammar(plain_llm, spec_llm):
    """A guided request guesses too (its lines repeat their keys: prompt lookup finds them):
    each of its rows is masked by the grammar's state after the guesses before it, which the
    request's own state never takes in, so outputs are plain guided decoding's."""
    prompts = ["Four people and their cities:\n", "Name four cities:\n"]
    params = SamplingParams(temperature=0.0, max_tokens=60, guided_decoding={"regex": PEOPLE})
    before = dataclasses.replace(spec_llm.engine.speculator.stats)
    plain, spec = (llm.generate(prompts, params, use_tqdm=False) for llm in (plain_llm, spec_llm))
    for p, s in zip(plain, spec, strict=True):
        assert (s.outputs[0].token_ids, s.outputs[0].finish_reason) == (p.outputs[0].token_ids, p.outputs[0].finish_reason)
        assert re.fullmatch(PEOPLE, s.outputs[0].text)
    stats = spec_llm.engine.speculator.stats
    assert stats.num_accepted_tokens - before.num_accepted_tokens > 20


def test_guesses_a_grammar_refuses_are_cut_off(default_model_dir):
    """Guesses past the first one the request's grammar refuses after its output are never
    proposed: they could not be kept."""
    from transformers import AutoTokenizer

    from worker.guided.structured_output import GuidedDecoding

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    guided = GuidedDecoding(tok, {tok.eos_token_id}, len(tok))
    grammar = guided.compile({"choice": ["yes please", "no thanks"]})
    for request_id in ("r", "s"):
        guided.add(request_id, grammar)
    yes, please, no = (tok.encode(text) for text in ("yes", " please", "no"))
    assert guided.fitting("r", [], yes + please + no) == yes + please
    assert guided.fitting("r", yes, please + please) == please  # (its grammar took "yes" in, not the guesses)
    assert guided.fitting("s", [], no + please) == no
    assert guided.fitting("unguided", [], no + please) == no + please


def test_preemption_and_chunked_prefill_keep_outputs(plain_llm):
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    small = {"num_gpu_blocks_override": 12, "max_model_len": 192, "max_num_batched_tokens": 24}
    plain = plain_llm.generate(PROMPTS * 2, params, use_tqdm=False)
    spec_llm = engine(spec=True, **small)
    spec = spec_llm.generate(PROMPTS * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert spec_llm.engine.scheduler.num_preemptions > 0 and spec_llm.engine.speculator.stats.num_accepted_tokens > 0


def test_no_guesses_at_or_above_disable_by_batch_size():
    config = {**NGRAM, "disable_by_batch_size": 2}
    llm = LLM(None, dtype="float32", num_gpu_blocks_override=256, max_model_len=1024, speculative_config=config)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm.generate(PROMPTS[:2], params, use_tqdm=False)  # two run together to the end
    assert llm.engine.speculator.stats.num_drafts == 0
    llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert llm.engine.speculator.stats.num_drafts > 0


def test_guesses_are_paced_by_how_they_fare():
    """All kept: one more next time (up to num_speculative_tokens); none kept: half, then
    none for a while, doubling while they keep failing; then one again."""
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4))
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1]  # "1" was followed by 2 3 4 5
    assert proposer.propose("a", tokens, 10) == [2, 3, 4, 5]
    proposer.record("a", 4, 0)
    assert proposer.propose("a", tokens, 10) == [2, 3]
    proposer.record("a", 2, 0)
    assert proposer.propose("a", tokens, 10) == [2]
    proposer.record("a", 1, 0)  # limit 0: one step without, then one guess
    assert [proposer.propose("a", tokens, 10) for _ in range(2)] == [[], [2]]
    proposer.record("a", 1, 0)  # failed again: two steps without
    assert [proposer.propose("a", tokens, 10) for _ in range(3)] == [[], [], [2]]
    proposer.record("a", 1, 1)
    assert proposer.propose("a", tokens, 10) == [2, 3]
    proposer.record("a", 2, 1)  # some kept: the same
    assert proposer.propose("a", tokens, 10) == [2, 3]


def test_a_predicted_output_is_guessed_from_and_changes_nothing(spec_llm):
    """OpenAI's predicted output: the n-gram proposer guesses from it as from the prompt, so
    a reply that repeats it keeps most guesses; the tokens are the same as without it."""
    prompt = "Tell me about your day in the garden with the children."
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def run(given: SamplingParams) -> tuple[list[int], int]:
        before = spec_llm.engine.speculator.stats.num_accepted_tokens
        [out] = spec_llm.generate(prompt, given, use_tqdm=False)
        return out.outputs[0].token_ids, spec_llm.engine.speculator.stats.num_accepted_tokens - before

    plain, kept_plain = run(params)
    text = spec_llm.get_tokenizer().decode(plain)
    predicted, kept = run(dataclasses.replace(params, prediction=text))
    assert predicted == plain
    assert kept >= 30 > kept_plain + 10, (kept, kept_plain)


def test_ngram_proposals():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3))
    tokens = [5, 1, 2, 3, 9, 8, 1, 2, 3]
    assert proposer.propose("a", tokens, 10) == [9, 8, 1]  # after the earlier "1 2 3"
    assert proposer.propose("a", tokens + [7], 10) == []  # "3 7", "7": never seen before
    assert proposer.propose("a", tokens + [7, 1, 2], 2) == [3, 7]  # the latest "1 2" wins; capped
    assert proposer.propose("b", [4], 10) == []
    proposer.remove("a")
    assert proposer.propose("a", [1, 2, 1], 10) == [2, 1]  # indexes from scratch
    # a lookup of prompt, predicted output and output (Request.lookup_token_ids): a guess stops at a part's end
    assert proposer.propose("c", [1, 2, 3, NO_TOKEN, 4, 5, NO_TOKEN, 4], 10) == [5]


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be 'ngram'"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown key"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be an int >= 1"),
])
def test_bad_speculative_config_is_refused_by_name(config, message):
    from worker.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=config)


def hf_next_token_probs(model, prompt_ids: list[int], continuations: list[tuple[int, ...]],
                        temperature: float) -> torch.Tensor:
    """transformers' distribution (at `temperature`) of the token after the prompt and each
    continuation (all of one length): [len(continuations), vocab]. The prompt runs once, its
    cache shared."""
    with torch.inference_mode():
        cache = model(torch.tensor([prompt_ids]), use_cache=True).cache
        cache.batch_repeat_interleave(len(continuations))
        logits = model(torch.tensor(continuations), cache=cache).logits[:, -1].float()
    return torch.softmax(logits / temperature, dim=-1)


def test_random_sampling_keeps_its_distribution(default_model_dir):
    """Unseeded random rows are guessed for too, and both the guessed token and the one
    sampled after it follow the model's distribution. transformers gives that distribution
    after each completion's own tokens before it; their mean over the completions is what
    the tokens' counts must follow (total variation over its five likeliest tokens and the
    rest, at a temperature that makes the guessed token uncertain)."""
    from transformers import AutoModelForCausalLM

    samples = 400  # completions of one prompt (n), which share its prefill
    temperature = 1.5
    # 17 tokens: the completions share the first block of 16 and each computes only the last.
    # Token 0 is likeliest " ", after which the prompt's own " " guesses token 1, a digit
    prompt = "1, 2, 3, 4, 1, 2,"
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, n=samples)
    # all the completions in one batch; bfloat16 where the CPU multiplies it natively (several
    # times faster than float32 there), float32 where it would be emulated (several times slower)
    dtype = "bfloat16" if can_pack(torch.device("cpu"), torch.bfloat16) else "float32"
    llm = engine(spec=True, dtype=dtype, max_num_seqs=samples, num_gpu_blocks_override=512)
    completions = [c.token_ids for c in llm.generate(prompt, params, use_tqdm=False)[0].outputs]
    assert llm.engine.speculator.stats.num_drafts > 100
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompt_ids = llm.get_tokenizer().encode(prompt)
    assert len(prompt_ids) == llm.engine.config.block_size + 1
    for k in (1, 2):  # the guessed token, and the one after it
        prefixes = sorted({tuple(c[:k]) for c in completions})
        probs = hf_next_token_probs(model, prompt_ids, prefixes, temperature)
        expected = probs[torch.tensor([prefixes.index(tuple(c[:k])) for c in completions])].mean(0)
        assert expected.max() < 0.8  # far from certain
        top = expected.topk(5).indices.tolist()
        counts = [sum(c[k] == t for c in completions) for t in top]
        observed = [n / samples for n in [*counts, samples - sum(counts)]]
        shares = [*expected[top].tolist(), 1 - expected[top].sum().item()]
        distance = sum(abs(a - b) for a, b in zip(observed, shares, strict=True)) / 2
        # 400 draws from these shares stray this far about once in two thousand; always keeping
        # the guess strays 0.23 (the guess is right about half the time)
        assert distance < 0.09, (k, distance, observed, shares)


# -- a draft model's guesses ---------------------------------------------------------------


def draft_engine(target, draft, **kwargs) -> LLM:
    spec = {"model": str(draft), "num_speculative_tokens": 3}
    return LLM(str(target), dtype="float32", num_gpu_blocks_override=128, speculative_config=spec, **kwargs)


@pytest.mark.parametrize("draft", ["itself", "another model"])
def test_draft_model_guesses_keep_plain_outputs(tiny_llama_dir, tiny_mistral_dir, draft):
    """A draft that is the target itself guesses right (nearly) every time; another model of the
    same vocabulary seldom does; either way every output is plain decoding's, with stop
    strings, penalties and logprobs."""
    prompts = PROMPTS
    plain = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=128)
    spec = draft_engine(tiny_llama_dir, tiny_llama_dir if draft == "itself" else tiny_mistral_dir)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = [llm.generate(prompts, greedy, use_tqdm=False) for llm in (plain, spec)]
    assert [o.outputs[0].token_ids for o in outs[1]] == [o.outputs[0].token_ids for o in outs[0]]
    stats = spec.engine.speculator.stats
    assert stats.num_draft_tokens > 24
    if draft == "itself":
        assert stats.acceptance_rate > 0.95
    else:
        assert stats.acceptance_rate < 0.5
    for params in (CASES["stop strings"], CASES["penalties and logprobs"], CASES["max tokens"]):
        a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (plain, spec))
        for p, s in zip(a, b, strict=True):
            assert (s.outputs[0].token_ids, s.outputs[0].finish_reason) == (p.outputs[0].token_ids, p.outputs[0].finish_reason)
    # its blocks come back as requests end
    proposer = spec.engine.speculator.proposer
    assert not proposer.blocks.tables and len(proposer.blocks.free) == proposer.runner.num_blocks


def test_a_split_targets_draft_is_whole_beside_rank_0(tiny_llama_dir):
    """Tensor parallelism splits the target over two ranks; the draft runs whole in rank 0's
    process, and guessing right (it is the target) changes no output."""
    plain = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=128)
    spec = draft_engine(tiny_llama_dir, tiny_llama_dir, tensor_parallel_size=2, num_threads=1)
    assert spec.engine.speculator.proposer.runner.model_config.num_attention_heads == 4  # the whole draft: 2 a rank split
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = [llm.generate(PROMPTS[:4], greedy, use_tqdm=False) for llm in (plain, spec)]
    assert [o.outputs[0].token_ids for o in outs[1]] == [o.outputs[0].token_ids for o in outs[0]]
    assert spec.engine.speculator.stats.acceptance_rate > 0.95


def test_a_hybrid_targets_draft_holds_what_one_kv_group_would(tiny_gemma3_layers_dir, tiny_llama_dir):
    """A hybrid target's blocks each hold a few of its layers, so it has more of them; the
    draft's pool (every draft layer a block) is sized as the target's would be with one
    group, not by that count. Outputs stay plain decoding's."""
    spec = draft_engine(tiny_gemma3_layers_dir, tiny_llama_dir, max_num_seqs=4)
    runner, proposer = spec.engine.runner, spec.engine.speculator.proposer
    assert runner.num_blocks > 128 and proposer.runner.num_blocks == 128 + 4 * (1 + 1)  # 3 guesses: one block
    plain = LLM(str(tiny_gemma3_layers_dir), dtype="float32", num_gpu_blocks_override=128, max_num_seqs=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = [llm.generate(PROMPTS[:4], greedy, use_tqdm=False) for llm in (plain, spec)]
    assert [o.outputs[0].token_ids for o in outs[1]] == [o.outputs[0].token_ids for o in outs[0]]


def test_a_draft_model_that_cannot_serve_is_refused(tiny_llama_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, max_position_embeddings=1024)
    LlamaForCausalLM(small).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"vocabulary \(512 tokens\) is not the target model's \(49152\)"):
        draft_engine(tiny_llama_dir, tmp_path)
    with pytest.raises(ValueError, match="needs a draft `model` directory exactly when method is 'draft_model'"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2})
