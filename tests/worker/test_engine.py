"""The engine against transformers on the same weights: greedy tokens must be identical in
float32, whatever the batching, chunking, preemption or prefix caching."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from producer.sampling_params import SamplingParams
from worker import LLM
from worker.core.scheduler import ScheduledRequest, SchedulerOutput
from worker.model_executor.attention import MATMUL_PREFILL_MAX_CONTEXT

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "a",
    "In a distant galaxy, far beyond the reach of any telescope, there lived " * 3,
    "def fibonacci(n):\n    ",
    "Les sciences naturelles étudient le monde 🌍 et ses lois; 数学 aussi.",
    "The quick brown fox jumps over the lazy dog. " * 6,
]
NEW_TOKENS = 32


def hf_greedy(model_dir, prompt_ids: list[list[int]], max_new: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy tokens, never stopping at EOS and never masking it (like ignore_eos;
    min_new_tokens would mask EOS instead)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    return out


def hf_greedy_along(model_dir, prompt_ids: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    """transformers' greedy choice at each position of each output, given its prompt and the
    output before it (teacher forcing). It equals `outputs` exactly when they are the tokens
    transformers' greedy decoding writes (as hf_greedy's, never stopping at EOS), and takes
    one forward per prompt where generate takes one per token."""
    return greedy_along(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), prompt_ids, outputs)


def greedy_along(model, prompt_ids: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    """hf_greedy_along's choices, of a model already loaded (a PEFT model, say)."""
    model = model.eval()
    with torch.inference_mode():
        return [model(torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1 :].argmax(-1).tolist() if out else []
                for ids, out in zip(prompt_ids, outputs, strict=True)]


def greedy(n=NEW_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def step_to_end(engine, requests: dict[str, tuple], in_use) -> tuple[list[list[int]], int]:
    """Add `requests` (id -> add_request's prompt and params) and step until all end: each one's
    tokens, in order, and the most that `in_use()` (slots held, say) read after any step."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    most = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
        most = max(most, in_use())
    return list(tokens.values()), most


def run_and_compare(llm: LLM, model_dir, prompts=PROMPTS):
    """The engine's greedy outputs (NEW_TOKENS each) are transformers' greedy tokens."""
    tok = llm.get_tokenizer()
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    tokens = [out.outputs[0].token_ids for out in outputs]
    expected = hf_greedy_along(model_dir, [tok.encode(p) for p in prompts], tokens)
    for prompt, out, ref in zip(prompts, outputs, expected, strict=True):
        assert len(out.outputs[0].token_ids) == NEW_TOKENS and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == ref, f"mismatch for {prompt[:30]!r}"
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)
    return outputs


def test_batches_past_a_heap_block_of_logits_keep_transformers_tokens(tiny_llama_dir):
    """200 and then 180 rows of float32 logits, more than a malloc heap block holds (170 of a
    49,152-token vocabulary): the LM head writes them in chunks into a buffer kept from step to
    step, and every token is still transformers' greedy token."""
    rng = random.Random(0)
    prompt_ids = [[rng.randrange(3, 49152) for _ in range(rng.randint(2, 6))] for _ in range(200)]
    params = [greedy(2 if i % 10 == 0 else 3) for i in range(200)]  # 200 rows, 200, then 180
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_num_seqs=256, num_gpu_blocks_override=512)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    tokens = [out.outputs[0].token_ids for out in outputs]
    assert [len(t) for t in tokens] == [p.max_tokens for p in params]
    assert tokens == hf_greedy_along(tiny_llama_dir, prompt_ids, tokens)
    assert llm.engine.runner.model.logits_buffer.capacity_rows == 200


def test_greedy_matches_transformers_tiny_families(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=256)
    run_and_compare(llm, tiny_model_dir)


@pytest.mark.slow
def test_greedy_matches_transformers_default_model(default_model_dir):
    llm = LLM(None, dtype="float32", max_model_len=2048, num_gpu_blocks_override=512)
    # real weights, two prompts: an instruction, and many scripts (the short ones and code are the
    # API tests' and the tiny models')
    run_and_compare(llm, default_model_dir, [PROMPTS[i] for i in (2, 7)])


def test_greedy_matches_transformers_mixtures_of_experts(tiny_moe_dir):
    llm = LLM(str(tiny_moe_dir), dtype="float32", num_gpu_blocks_override=256)
    run_and_compare(llm, tiny_moe_dir)


def test_prefill_logits_match_transformers(tiny_model_dir):
    check_prefill_logits(tiny_model_dir, "torch")


def test_greedy_matches_transformers_sliding_windows(tiny_window_dir):
    """Prompts and outputs far past the 24-position window, in the windowed layers' masks."""
    llm = LLM(str(tiny_window_dir), dtype="float32", num_gpu_blocks_override=256)
    assert llm.engine.max_model_len == 1024  # the window no longer caps the context
    run_and_compare(llm, tiny_window_dir)


def test_prefill_logits_match_transformers_sliding_windows(tiny_window_dir):
    check_prefill_logits(tiny_window_dir, "torch")


def test_prefill_logits_match_transformers_mixtures_of_experts(tiny_moe_dir):
    check_prefill_logits(tiny_moe_dir, "torch")


# The kernel path (attention, KV writes, norms, rotary, fused MoE) under the interpreter costs
# seconds a model, so it runs for the models whose kernel launches differ: GQA and MHA, a
# window on some layers, capped scores with a window (Gemma 2), a RoPE table per layer kind
# (Gemma 3), routed experts with a shared one, RoPE over part of heads 24 wide (Phi-3's tiny
# model, GQA too: tiles padded to 32 columns). The other families differ in torch code only.
@pytest.mark.parametrize("tiny_model_dir", ["mistral", "phi3", "gemma2", "gemma3", "qwen3_5"], indirect=True)
def test_prefill_logits_match_transformers_kernel_path(tiny_model_dir):
    check_prefill_logits(tiny_model_dir, "triton")


@pytest.mark.parametrize("tiny_window_dir", ["qwen2_window"], indirect=True)
def test_prefill_logits_match_transformers_kernel_path_window(tiny_window_dir):
    check_prefill_logits(tiny_window_dir, "triton")


# gpt-oss: sinks, biased experts; DeepSeek-V3: latent attention, and GLM-4.5's routing too (float32
# weights over one from routed_scaling_factor, a plain shared expert), so glm4_moe is not run apart;
# MiniMax-M2: that routing beside whole-projection q/k norms and partial RoPE
@pytest.mark.parametrize("tiny_moe_dir", ["qwen2_moe", "gpt_oss", "deepseek_v3", "llama4", "nemotron_3_latent", "minimax_m2"],
                         indirect=True)
def test_prefill_logits_match_transformers_kernel_path_experts(tiny_moe_dir):
    check_prefill_logits(tiny_moe_dir, "triton")


# The compiled CPU kernel (kernels/cpu) on the models whose attention differs: GQA and MHA, a
# window on some layers, capped scores with a window (Gemma 2), sinks (gpt-oss); latent
# attention's head size (DeepSeek-V3) takes the torch path inside the cpu backend
@pytest.mark.parametrize("tiny_model_dir", ["llama", "mistral", "gemma2", "gemma3"], indirect=True)
def test_prefill_logits_match_transformers_cpu_kernels(tiny_model_dir):
    llm = check_prefill_logits_against(tiny_model_dir, tiny_model_dir, "cpu")
    assert llm.engine.runner.attention.kernel_serves  # (head sizes 16 and 32)


@pytest.mark.parametrize("tiny_moe_dir", ["gpt_oss", "deepseek_v3"], indirect=True)
def test_prefill_logits_match_transformers_cpu_kernels_experts(tiny_moe_dir, request):
    llm = check_prefill_logits_against(tiny_moe_dir, tiny_moe_dir, "cpu")
    assert llm.engine.runner.attention.kernel_serves == (request.node.callspec.params["tiny_moe_dir"] == "gpt_oss")


def check_prefill_logits(tiny_model_dir, backend):
    check_prefill_logits_against(tiny_model_dir, tiny_model_dir, backend)


def check_prefill_logits_against(tiny_model_dir, reference_dir, backend, engine_args=None, **hf_kwargs) -> LLM:
    """Three requests in two steps (two of them chunked) against transformers' last logits
    (of the model in `reference_dir`, loaded with `hf_kwargs`). Returns the engine's LLM."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64, device=device,
              attention_backend=backend, **(engine_args or {}))
    assert llm.engine.runner.model.use_kernels == (backend == "triton")
    hf = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32, **hf_kwargs).eval()
    runner = llm.engine.runner
    torch.manual_seed(0)
    a, b = torch.randint(3, 49152, (45,)).tolist(), torch.randint(3, 49152, (17,)).tolist()
    # on the torch path c is long enough that both its chunks attend to more than
    # MATMUL_PREFILL_MAX_CONTEXT positions (SDPA); a and b stay under it (matmuls). The
    # kernel has no such branch (and the interpreter is slow): there c spans two KV tiles of 64,
    # its second chunk starting mid-block and mid-tile
    c_len, cut = (300, 270) if backend == "torch" else (100, 70)
    c = torch.randint(3, 49152, (c_len,)).tolist()
    c_blocks = list(range(5, 24))
    assert backend != "torch" or cut > MATMUL_PREFILL_MAX_CONTEXT
    def request(rid, ids, start, table, sample):  # each further KV group's blocks 32 on (a hybrid model has two)
        more = tuple([b + 32 * g for b in table] for g in range(1, len(runner.kv_layout)))
        return ScheduledRequest(rid, ids, start, table, sample, group_tables=more)

    # a and c chunked across two steps (their second chunks attend to their cached first), b whole
    runner.execute(SchedulerOutput([request("a", a[:20], 0, [0, 1, 2], False), request("b", b, 0, [3, 4], True),
                                    request("c", c[:cut], 0, c_blocks, False)]))
    out = runner.execute(SchedulerOutput([request("a", a[20:], 20, [0, 1, 2], True), request("b", [7], 17, [3, 4], True),
                                          request("c", c[cut:], cut, c_blocks, True)]))
    with torch.inference_mode():
        ref = {"a": hf(torch.tensor([a])).logits[0, -1], "b": hf(torch.tensor([b + [7]])).logits[0, -1],
               "c": hf(torch.tensor([c])).logits[0, -1]}
    got = dict(zip(out.request_ids, out.logits.cpu(), strict=True))
    for name, expected in ref.items():
        assert torch.allclose(got[name], expected, atol=1e-4, rtol=0), name
    return llm


def test_longrope_matches_transformers_short_and_long(tiny_longrope_dir):
    """LongRoPE (Phi-3.5): transformers rotates by the short factors while a sequence is within
    the original 64 positions and by the long ones past it. The engine picks one set for every
    sequence, by the longest it serves: each engine is checked on sequences of its own kind."""
    short = LLM(str(tiny_longrope_dir), dtype="float32", max_model_len=64, num_gpu_blocks_override=64)
    assert not short.engine.runner.model_config.long_rope
    run_and_compare(short, tiny_longrope_dir, PROMPTS[:3])  # prompts and their 32 tokens stay within 64
    long = LLM(str(tiny_longrope_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    assert long.engine.runner.model_config.long_rope
    run_and_compare(long, tiny_longrope_dir, [PROMPTS[8] * 2, PROMPTS[5] * 2])  # prompts past 64


def test_image_text_models_serve_their_language_model(tiny_image_text_dir):
    """Gemma 3 (4B and up) and Mistral Small 3.x ship as image-text models: genq loads the
    language model alone and its text replies equal transformers' image-text model's."""
    from transformers import AutoModelForImageTextToText

    llm = LLM(str(tiny_image_text_dir), dtype="float32", num_gpu_blocks_override=64)
    tok = llm.get_tokenizer()
    hf = AutoModelForImageTextToText.from_pretrained(tiny_image_text_dir, dtype=torch.float32).eval()
    if type(hf).__name__ == "Llama4ForConditionalGeneration":
        # text alone, it runs its language model as it is; its own forward fails building
        # its output in transformers 5.24 (no image_outputs on the language model's)
        hf = hf.language_model
    hf.generation_config.eos_token_id = None
    outputs = llm.generate(PROMPTS[:3], greedy(12), use_tqdm=False)
    for prompt, out in zip(PROMPTS[:3], outputs, strict=True):
        ids = tok.encode(prompt)
        with torch.inference_mode():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == expected[0, len(ids):].tolist(), prompt


def test_generation_config_eos_ids_end_replies(tiny_llama_dir, tmp_path):
    """generation_config.json may list EOS ids that config.json does not (gpt-oss's <|call|>,
    Llama 3's <|eot_id|>): a reply ends at the first, where transformers' generate ends it."""
    shutil.copytree(tiny_llama_dir, tmp_path, dirs_exist_ok=True)
    free = LLM(str(tmp_path), dtype="float32", num_gpu_blocks_override=64).generate(
        PROMPTS[0], greedy(16), use_tqdm=False)[0].outputs[0].token_ids
    at = next(i for i in range(3, 16) if free[i] not in free[:i])  # a token first written at step `at`
    config = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, free[at]]}))
    llm = LLM(str(tmp_path), dtype="float32", num_gpu_blocks_override=64)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(ids):]
    assert out.token_ids == expected.tolist() == free[: at + 1]
    assert out.finish_reason == "stop"


def test_a_cache_salt_shares_blocks_only_with_its_own_salt(tiny_llama_dir):
    """vLLM's cache_salt: a salted prompt is served from the prefix cache only by blocks a
    prompt of the same salt left (tenants cannot learn each other's prompts by their speed);
    the tokens are the same either way."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    ids = llm.get_tokenizer().encode(PROMPTS[8])  # 60 tokens: 3 whole blocks
    runs = [(None, 0), ("tenant-a", 0), ("tenant-a", 48), ("tenant-b", 0), (None, 48), ("tenant-b", 48)]
    outs = []
    for salt, cached in runs:
        prompt = {"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})}
        [out] = llm.generate(prompt, greedy(6), use_tqdm=False)
        assert out.num_cached_tokens == cached, (salt, out.num_cached_tokens)
        outs.append(out.outputs[0].token_ids)
    assert all(o == outs[0] for o in outs)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string, got ''"):
        llm.generate({"prompt": "x", "cache_salt": ""}, greedy(2), use_tqdm=False)


def test_preemption_gives_the_same_output(tiny_llama_dir):
    # 12 blocks of 16 tokens cannot hold 9 sequences of up to ~90 tokens: preemption must happen.
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=12, max_model_len=192)
    run_and_compare(llm, tiny_llama_dir)
    assert llm.engine.scheduler.num_preemptions > 0
    # every row of the persistent batch was given back (preempted, finished): a later request's
    # step finds only its own (the runner hears of an end at the step after it)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(2), use_tqdm=False)
    assert len(llm.engine.runner.input_batch) <= 1


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching_reuses_blocks_and_keeps_outputs(tiny_llama_dir, prefix_caching):
    llm = LLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=prefix_caching,
              num_gpu_blocks_override=256)
    system = "You are a careful assistant. Answer briefly and truthfully. " * 4
    prompts = [system + q for q in ("What is 2+2?", "Name a colour.", "Where is Paris?")]
    run_and_compare(llm, tiny_llama_dir, prompts[:1])  # fills the cache
    run_and_compare(llm, tiny_llama_dir, prompts[1:])
    hits = llm.engine.block_manager.stats.hits
    assert (hits > 0) if prefix_caching else (hits == 0)
    outs = llm.generate(prompts[1:], greedy(4), use_tqdm=False)
    assert all((o.num_cached_tokens > 0) == prefix_caching for o in outs)
    llm.reset_prefix_cache()  # vLLM's: the next prompts are computed afresh, with the same outputs
    again = llm.generate(prompts[1:], greedy(4), use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [0, 0]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_a_reset_keeps_later_requests_off_the_blocks_running_ones_hold(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    engine, prompt = llm.engine, {"prompt_token_ids": list(range(5, 41))}  # (two full blocks)
    engine.add_request("running", prompt, greedy(8))
    engine.step()  # its prompt's blocks are computed and cached, and it holds them
    engine.reset_prefix_cache()
    engine.add_request("later", prompt, greedy(1))
    cached = {}
    while engine.has_unfinished_requests():
        cached |= {out.request_id: out.num_cached_tokens for out in engine.step() if out.finished}
    assert cached == {"running": 0, "later": 0}


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_chunked_prefill_with_small_token_budget(tiny_llama_dir, backend):
    """On the compiled CPU kernels (what auto picks on the CPU, so the other tests here too)
    and on the torch path: prefill chunks beside decodes, each step."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=24, num_gpu_blocks_override=256,
              attention_backend=backend)
    assert llm.engine.runner.backend == backend
    run_and_compare(llm, tiny_llama_dir)


def test_step_time_aware_chunks_keep_transformers_tokens(tiny_llama_dir):
    """max_step_ms: a cost model taught that a prompt token costs 10 ms (primed, so that the
    real steps' noise cannot unteach it within the run) leaves every step the floor, a block
    of prompt tokens; the outputs are still transformers' greedy tokens."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_step_ms=1.0, num_gpu_blocks_override=256)
    cost = llm.engine.step_cost
    for _ in range(3):
        cost.observe(1.0, 0, 100)
        cost.observe(0.0, 0, 0)
    outputs = run_and_compare(llm, tiny_llama_dir)
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    block = llm.engine.config.block_size
    assert cost.num_prefill_steps - 3 >= prompt_tokens / block  # (without it: one step for them all)


def test_bad_prompts_raise_and_engine_keeps_working(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, num_gpu_blocks_override=64)
    engine = llm.engine
    engine.add_request("good", "Hello there", greedy(8))
    with pytest.raises(ValueError, match="max_model_len is 64"):
        engine.add_request("long", {"prompt_token_ids": [5] * 64}, greedy())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", {"prompt_token_ids": []}, greedy())
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 49152\)"):
        engine.add_request("oov", {"prompt_token_ids": [5, 49152]}, greedy())
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate(["fine", {"prompt_token_ids": [-1]}], greedy(), use_tqdm=False)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert list(finished) == ["good"]
    assert llm.generate("Hello there", greedy(8), use_tqdm=False)[0].outputs[0].token_ids


def test_a_prompt_and_max_tokens_past_max_model_len_are_refused_not_clamped(tiny_llama_dir):
    """vLLM's rule: prompt plus max_tokens must fit max_model_len, else the request is refused
    naming both numbers (never quietly cut short); max_tokens None runs up to max_model_len."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, num_gpu_blocks_override=64)
    prompt = {"prompt_token_ids": list(range(5, 45))}  # 40 tokens: room for 24
    with pytest.raises(ValueError, match=r"maximum context length is 64 tokens\. However, you requested "
                                         r"65 tokens \(40 in the prompt, 25 in the completion\)"):
        llm.engine.add_request("over", prompt, greedy(25))
    with pytest.raises(ValueError, match=r"requested 1000000040 tokens"):
        llm.engine.add_request("far-over", prompt, greedy(10**9))
    assert not llm.engine.has_unfinished_requests()  # refused before anything was queued
    fits = llm.generate(prompt, greedy(24), use_tqdm=False)[0].outputs[0]
    unbounded = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert len(fits.token_ids) == len(unbounded.token_ids) == 24
    assert fits.finish_reason == unbounded.finish_reason == "length"
    # truncate_prompt_tokens -1 keeps as many as leave room for the tokens asked for
    cut = llm.generate({"prompt_token_ids": list(range(5, 105))}, SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert cut.prompt_token_ids == list(range(49, 105)) and len(cut.outputs[0].token_ids) == 8


def test_truncate_prompt_tokens_keeps_the_prompts_tail(tiny_llama_dir):
    """vLLM's truncate_prompt_tokens: a long prompt generates as its last k tokens would
    (transformers on those tokens is the oracle); -1 keeps as many as leave room for output."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, num_gpu_blocks_override=64)
    ids = [(7 * i) % 4000 + 5 for i in range(100)]
    for k, kept in ((12, ids[-12:]), (-1, ids[-63:])):
        params = SamplingParams(temperature=0.0, max_tokens=1 if k == -1 else 8, ignore_eos=True,
                                truncate_prompt_tokens=k)
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        assert out.prompt_token_ids == kept
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, [kept], params.max_tokens)[0]
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens must be >= 1 \(-1 keeps"):
        SamplingParams(truncate_prompt_tokens=0)


def test_abort_frees_blocks_and_reports(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    engine = llm.engine
    engine.add_request("x", "Tell me a story", greedy(100))
    engine.step()
    engine.abort_request("x")
    assert engine.block_manager.num_free_blocks == 64
    outs = engine.step()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_chat_applies_template(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    out = llm.chat([{"role": "user", "content": "hi"}], greedy(4), use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>") and out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 4


ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize(("change", "error"), [
    ({"architectures": ["GPT2LMHeadModel"]}, r"unsupported architecture 'GPT2LMHeadModel'; supported: .*Phi3ForCausalLM"),
    ({"rope_parameters": {**ROPE, "rope_type": "dynamic", "factor": 2.0}}, r"unsupported rope scaling 'dynamic'"),
    ({"rope_parameters": {**ROPE, "partial_rotary_factor": 0.7}}, r"rotates 11 of 16 columns per head; .* even"),
])
def test_what_the_engine_cannot_run_is_refused_by_name(change, error):
    """Dynamic NTK scaling (its frequencies change with the length) and a rotary over an odd
    number of columns compute something else: refused before any weight is read, not served
    wrongly."""
    from transformers import Phi3Config

    from worker.model_executor.models.config import ModelConfig

    config = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=error):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize("backend", ["torch"])  # the kernel path's release: the hybrid test below
@pytest.mark.parametrize("tiny_window_dir", ["mistral_window"], indirect=True)
def test_a_window_model_runs_sequences_longer_than_its_cache(tiny_window_dir, backend):
    """Every layer sees its last 24 positions, so blocks before that are given back as the
    requests run: two sequences of 200+ tokens each fit in a cache of 8 blocks (128 tokens),
    and still equal transformers, which keeps everything."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    new = 160 if backend == "torch" else 12  # the interpreter is slow: past the window all the same
    llm = LLM(str(tiny_window_dir), dtype="float32", num_gpu_blocks_override=8, max_num_batched_tokens=32,
              device=device, attention_backend=backend)
    assert llm.engine.block_manager.windows == [24]
    tok = llm.get_tokenizer()
    prompts = [PROMPTS[5], PROMPTS[8]]  # 40 and 60 tokens
    expected = hf_greedy(tiny_window_dir, [tok.encode(p) for p in prompts], max_new=new)
    outputs = llm.generate(prompts, greedy(new), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert sum(len(tok.encode(p)) for p in prompts) + 2 * new > 8 * 16
    assert llm.engine.block_manager.num_free_blocks == 8


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("tiny_window_dir", ["qwen2_window"], indirect=True)
def test_a_hybrid_model_keeps_whole_sequences_only_in_its_full_layers(tiny_window_dir, backend):
    """Layer 0 attends to everything, layer 1 to its last 24 positions: each has a block
    table of its own over one pool, a block being one layer's, and layer 1's blocks go back
    to the pool as they leave its window. Two sequences of 200+ tokens, which would take 54
    blocks with every block kept, run at once in 48 and still equal transformers."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    new = 160 if backend == "torch" else 12  # the interpreter is slow: past the window all the same
    llm = LLM(str(tiny_window_dir), dtype="float32", num_gpu_blocks_override=24, max_model_len=256,
              max_num_batched_tokens=32, device=device, attention_backend=backend)
    engine = llm.engine
    assert engine.block_manager.windows == [None, 24] and engine.runner.num_blocks == 48  # 24 of both layers'
    assert engine.runner.kv_caches[0][0].data_ptr() == engine.runner.kv_caches[1][0].data_ptr()
    tok = llm.get_tokenizer()
    prompts = [PROMPTS[5], PROMPTS[8]]  # 40 and 60 tokens
    expected = hf_greedy(tiny_window_dir, [tok.encode(p) for p in prompts], max_new=new)
    outputs = llm.generate(prompts, greedy(new), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if backend == "torch":
        assert 2 * sum(-(-(len(tok.encode(p)) + new) // 16) for p in prompts) == 54
        assert engine.scheduler.num_preemptions == 0
    assert engine.block_manager.num_free_blocks == 48


@pytest.mark.parametrize("tiny_window_dir", ["qwen2_window"], indirect=True)
def test_a_hybrid_models_prefix_hits_read_the_right_windows(tiny_window_dir):
    """A prompt that extends a finished one starts from the prefix cache: the full layer's
    blocks from position 0, the windowed layer's only over the 24 positions before the hit
    (the rest released long ago). Its greedy tokens still equal transformers'."""
    llm = LLM(str(tiny_window_dir), dtype="float32", num_gpu_blocks_override=64)
    check_a_prefix_hit(llm, tiny_window_dir)


def check_a_prefix_hit(llm: LLM, model_dir) -> None:
    """A prompt that extends a finished one (of 60 tokens) reads three full blocks of it from
    the prefix cache, and its greedy tokens equal transformers'."""
    tok = llm.get_tokenizer()
    first = tok.encode(PROMPTS[8])
    llm.generate({"prompt_token_ids": first}, greedy(8), use_tqdm=False)
    extended = first + tok.encode(" And then the fox slept.")
    [out] = llm.generate({"prompt_token_ids": extended}, greedy(16), use_tqdm=False)
    assert out.num_cached_tokens == 48
    assert out.outputs[0].token_ids == hf_greedy_along(model_dir, [extended], [out.outputs[0].token_ids])[0]


@pytest.mark.parametrize("tiny_moe_dir", ["llama4"], indirect=True)
def test_llama4_chunked_layers_keep_only_their_chunk(tiny_moe_dir):
    """Llama 4's chunked layer (chunks of 16) reads at most its last 16 positions, so its KV
    is kept as a window of 16 would keep it, in a group of its own; its NoPE layer keeps
    everything. A prompt extending a finished one reads its prefix from the cache; then two
    sequences of 200+ tokens, which would take 54 blocks with every block kept, run at once
    in 48. Greedy tokens equal transformers' throughout."""
    llm = LLM(str(tiny_moe_dir), dtype="float32", num_gpu_blocks_override=24, max_model_len=256,
              max_num_batched_tokens=32)
    engine = llm.engine
    assert engine.runner.kv_layout == [(None, (1,)), (16, (0,))] and engine.block_manager.windows == [None, 16]
    check_a_prefix_hit(llm, tiny_moe_dir)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(PROMPTS[5]), tok.encode(PROMPTS[7] + PROMPTS[6])]  # 46 and 36 tokens, not cached
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], greedy(160), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens == hf_greedy_along(tiny_moe_dir, prompts, tokens)
    assert 2 * sum(-(-(len(ids) + 160) // 16) for ids in prompts) > 48 and engine.scheduler.num_preemptions == 0


def test_a_hybrid_model_with_several_windowed_groups_matches_transformers(tiny_gemma3_layers_dir):
    """Three windowed layers to one full one (Gemma 3's five to one, shrunk): four groups of
    one layer, three of them windowed, whose step metadata shares its masks; greedy outputs
    far past the window still equal transformers'."""
    model_dir = tiny_gemma3_layers_dir
    # (the torch backend's metadata: its masks are what the groups share)
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64, attention_backend="torch")
    runner = llm.engine.runner
    assert runner.kv_layout == [(None, (2,)), (24, (0,)), (24, (1,)), (24, (3,))] and runner.num_blocks == 256
    _, _, meta = runner._prepare([ScheduledRequest("a", list(range(3, 43)), 0, [0, 1, 2], True,
                                                   group_tables=([3, 4, 5], [6, 7, 8], [9, 10, 11]))])
    windowed = [meta.for_layer(i).prefills[0] for i in (0, 1, 3)]
    assert windowed[0].masks is windowed[1].masks is windowed[2].masks
    assert meta.for_layer(2).prefills[0].masks is not windowed[0].masks
    run_and_compare(llm, model_dir, [PROMPTS[5], PROMPTS[8]])


def test_several_windowed_groups_on_the_kernel_path(tiny_gemma3_layers_dir):
    """The same model's prefill logits on the kernel path, whose windowed groups share their
    query starts and context lengths."""
    check_prefill_logits(tiny_gemma3_layers_dir, "triton")


@pytest.mark.parametrize("tiny_window_dir", ["qwen2_window"], indirect=True)
def test_a_hybrid_model_fits_twice_the_tokens_in_the_same_memory(tiny_window_dir):
    """One full and one windowed layer: a block of the pool is one layer's, so the memory of N
    blocks of both layers holds 2N, and a long sequence takes about one per 16 tokens."""
    common = {"dtype": "float32", "kv_cache_memory_gb": 0.01, "max_num_seqs": 4}
    one_pool = LLM(str(tiny_window_dir), disable_hybrid_kv_cache_manager=True, **common).engine
    hybrid = LLM(str(tiny_window_dir), **common).engine
    assert len(one_pool.runner.kv_layout) == 1 and len(hybrid.runner.kv_layout) == 2
    assert hybrid.block_manager.num_blocks == 2 * one_pool.block_manager.num_blocks

    def kv_bytes(runner) -> int:
        return sum(t.numel() * t.element_size() for t in {id(t): t for layer in runner.kv_caches for t in layer}.values())

    assert kv_bytes(hybrid.runner) == kv_bytes(one_pool.runner) <= 0.01 * 2**30
    assert hybrid.block_manager.blocks_needed(1600) == 100 + 2 and one_pool.block_manager.blocks_needed(1600) == 100


def test_a_backlog_of_prompts_takes_the_static_budget(tiny_llama_dir):
    """More prompt tokens waiting than BACKLOG_BUDGETS steps of the static budget (a burst):
    step-time-aware chunking gives way to it until the backlog is down to that, then holds each
    step to its floor again (the cost model primed as above: a prompt token costs 10 ms)."""
    from worker.core.engine import BACKLOG_BUDGETS

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_step_ms=1.0, max_num_batched_tokens=64,
              num_gpu_blocks_override=256)
    engine, cost = llm.engine, llm.engine.step_cost
    for _ in range(3):
        cost.observe(1.0, 0, 100)
        cost.observe(0.0, 0, 0)
    for i in range(6):  # 240 prompt tokens: past 2 x 64
        engine.add_request(str(i), {"prompt_token_ids": [5 + i] * 40}, greedy(4))
    carried = []
    while engine.has_unfinished_requests():
        pending = engine.scheduler.num_prompt_tokens_pending()
        engine.step()
        carried.append((pending, engine.last_step.prefill_tokens))
    assert BACKLOG_BUDGETS == 2 and carried[0] == (240, 64)
    for pending, prefill in carried:
        if pending > 128:
            assert prefill >= 60  # the static budget, but for the decodes it carries
        elif pending:
            assert prefill <= engine.config.block_size  # the cost model's floor
    assert any(0 < pending <= 128 for pending, _ in carried)  # (both kinds of step were seen)
