"""Qwen3.5's linear attention (Gated DeltaNet) beyond greedy parity (tests/worker/test_engine.py
has that, for the tiny Qwen3.5 of `tiny_model_dir`): the delta rule against transformers' own
per-token recurrence, each request's state across chunks, preemption and n > 1, and what is
refused because a state cannot be shared or taken back."""

from __future__ import annotations

import pytest
import torch
from test_engine import PROMPTS, greedy, hf_greedy_along, step_to_end

from producer.sampling_params import SamplingParams
from worker import LLM
from worker.model_executor.models.linear_attention import gated_delta_rule


@pytest.fixture(scope="module")
def qwen3_5(tiny_family):
    return tiny_family("qwen3_5")


@pytest.mark.parametrize("length", [1, 5, 64, 150])  # a decode; under a chunk; one chunk; three, the last short
def test_the_chunked_delta_rule_equals_transformers_recurrence(length):
    """Tokens solved a chunk at a time, from a state the tokens before left, give the outputs
    and the final state of transformers' token-by-token recurrence, and the state after the
    first half (a chunk ends there) that the recurrence has after it."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    torch.manual_seed(length)
    heads, dk, dv = 3, 16, 24
    q, k = torch.randn(2, length, heads, dk).unbind(0)
    v = torch.randn(length, heads, dv)
    g = -torch.rand(length, heads) * 2  # log decays
    beta = torch.rand(length, heads)
    state = torch.randn(heads, dk, dv)
    expected, expected_state = torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None].clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    # ours takes q and k normalized, q scaled, as the layer gives them
    qn, kn = (t * torch.rsqrt(t.square().sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    ours = state.clone()
    stop = torch.full_like(state, float("nan"))  # the state after the first `length // 2 + 1` tokens
    out = gated_delta_rule(qn * dk**-0.5, kn, v, g, beta, ours, {length // 2 + 1: [stop]})
    torch.testing.assert_close(out, expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours, expected_state[0], atol=1e-4, rtol=1e-4)
    n = length // 2 + 1
    _, expected_stop = torch_recurrent_gated_delta_rule(
        q[None, :n], k[None, :n], v[None, :n], g[None, :n], beta[None, :n], initial_state=state[None].clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(stop, expected_stop[0], atol=1e-4, rtol=1e-4)


def test_states_survive_chunks_preemption_and_n(qwen3_5):
    """Without states kept for the prefix cache: prompts cut into chunks of 16 tokens, a pool
    so small that requests are preempted (and start over with a fresh state), and two
    completions of one prompt, each computing it: greedy tokens equal transformers'. No
    prefix is ever read from the cache."""
    llm = LLM(str(qwen3_5), dtype="float32", num_gpu_blocks_override=10, max_num_batched_tokens=16, max_model_len=128,
              num_state_snapshots=0)
    engine = llm.engine
    assert not engine.block_manager.enable_prefix_caching  # no state kept: no prefix either
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in (PROMPTS[5], PROMPTS[8], PROMPTS[7])]  # 46, 61 and 29 tokens
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], greedy(40), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens == hf_greedy_along(qwen3_5, prompts, tokens)
    assert engine.scheduler.num_preemptions > 0
    params = greedy(12)
    params.n = 2
    [twice] = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
    assert [c.token_ids for c in twice.outputs] == [tokens[0][:12]] * 2
    assert twice.num_cached_tokens == 0
    assert not engine.runner.states.slots  # every request gave its slot back as it ended


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])  # 2: each rank holds half of every state and KV block
def test_requests_run_at_once_as_their_states_fit_the_cache(qwen3_5, tensor_parallel_size):
    """A cache that holds two requests' states beside a whole sequence's KV each: two of four
    run at once (max_num_seqs is lowered), and every one decodes as transformers; a cache too
    small for one is refused by name."""
    layers, conv_dim = 2, 2 * 2 * 16 + 4 * 24  # the tiny Qwen3.5's linear layers: q, k of 2 heads of 16, v of 4 of 24
    state = layers * (conv_dim * 3 * 4 + 4 * 16 * 24 * 4)  # the convolution's last 3 inputs, the recurrent matrices
    kv = 8 * (2 * 2 * 16 * 2 * 32 * 4)  # max_model_len 128: 8 blocks of 16 of K and V, 2 layers, 2 heads of 32
    per_request = (state + kv) / tensor_parallel_size
    llm = LLM(str(qwen3_5), dtype="float32", max_num_seqs=4, max_model_len=128, num_state_snapshots=0,
              kv_cache_memory_gb=2.5 * per_request / 2**30, tensor_parallel_size=tensor_parallel_size, num_threads=1)
    engine = llm.engine
    assert engine.max_num_seqs == engine.runner.states.max_requests == 2
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:4]]
    tokens, most = step_to_end(engine, {str(k): ({"prompt_token_ids": ids}, greedy(12)) for k, ids in enumerate(prompts)},
                               lambda: len(engine.runner.states.slots))
    assert most == 2
    assert tokens == hf_greedy_along(qwen3_5, prompts, tokens)
    if tensor_parallel_size == 1:
        with pytest.raises(ValueError, match=r"one request needs 0 MiB \(0 MiB of states of its own, 0 MiB of KV "
                                             r"cache\), more than the cache's 0 MiB"):
            LLM(str(qwen3_5), dtype="float32", max_model_len=128, kv_cache_memory_gb=0.5 * per_request / 2**30)


def kept_every_16(qwen3_5, **args) -> LLM:
    """States kept every 16 tokens, prompts in chunks of 24 tokens, blocks for 160 tokens."""
    return LLM(str(qwen3_5), dtype="float32", num_gpu_blocks_override=10, max_num_batched_tokens=24, max_model_len=128,
               mamba_block_size=16, num_state_snapshots=12, **args)


@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton: the kernel path, whose scan saves the states
def test_the_prefix_cache_serves_prefixes_from_the_states_it_keeps(qwen3_5, backend):
    """A state kept every 16 tokens: chunks of 24 save those at 16 and 32 mid-chunk, decodes
    those they pass. A prompt sharing 40 tokens with a finished one starts from the state at
    32; one that goes on from a finished exchange (prompt and output) from the state its
    output's decodes saved at 64. Greedy tokens equal transformers': any wrong state would
    change them."""
    llm = kept_every_16(qwen3_5, attention_backend=backend, enforce_eager=True)
    tok = llm.get_tokenizer()
    first = tok.encode(PROMPTS[5])  # 46 tokens: the states at 16, 32, 48 and 64 are saved
    [out] = llm.generate({"prompt_token_ids": first}, greedy(20), use_tqdm=False)
    answer = out.outputs[0].token_ids
    shared = first[:40] + tok.encode(" and nothing else")
    follow_up = first + answer + tok.encode(" Tell me more.")
    for ids, cached in ((shared, 32), (follow_up, 64)):
        [out] = llm.generate({"prompt_token_ids": ids}, greedy(16), use_tqdm=False)
        assert out.num_cached_tokens == cached
        assert out.outputs[0].token_ids == hf_greedy_along(qwen3_5, [ids], [out.outputs[0].token_ids])[0]


def test_preempted_requests_resume_from_their_states(qwen3_5):
    """Requests preempted for blocks come back to the states they saved (prefix hits of their
    own), and their greedy tokens equal transformers'."""
    llm = kept_every_16(qwen3_5)
    engine = llm.engine
    tok = llm.get_tokenizer()
    hits = engine.block_manager.stats.hits
    prompts = [tok.encode(p) for p in (PROMPTS[8], PROMPTS[7], PROMPTS[6])]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], greedy(40), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens == hf_greedy_along(qwen3_5, prompts, tokens)
    assert engine.scheduler.num_preemptions > 0 and all(o.num_cached_tokens == 0 for o in outputs)
    assert engine.block_manager.stats.hits > hits  # the preempted came back to their states
    assert not engine.runner.states.slots


def test_completions_of_one_prompt_start_from_its_state(qwen3_5):
    """n = 3 completions of a 46-token prompt: the first computes it, saving its state after
    its full blocks less the last token's (32 tokens), where the others start, as they share
    its blocks. Greedy, each equals transformers'; seeded random sampling, each equals a
    request of its own with its seed."""
    from producer.sampling_params import SamplingParams

    llm = LLM(str(qwen3_5), dtype="float32", num_gpu_blocks_override=64, max_model_len=128, num_state_snapshots=8)
    engine = llm.engine
    prompt = llm.get_tokenizer().encode(PROMPTS[5])
    computed = []
    schedule = engine.scheduler.schedule

    def recorded(*budget):  # the scheduler's own output, noted
        out = schedule(*budget)
        computed.extend(min(len(s.token_ids), len(prompt) - s.start_pos) for s in out.scheduled
                        if s.start_pos < len(prompt))
        return out

    engine.scheduler.schedule = recorded
    params = greedy(8)
    params.n = 3
    [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == hf_greedy_along(qwen3_5, [prompt], [out.outputs[0].token_ids]) * 3
    assert sum(computed) == 46 + 2 * 14
    seeded = SamplingParams(temperature=1.0, max_tokens=8, seed=5, n=3)
    [forked] = llm.generate({"prompt_token_ids": prompt}, seeded, use_tqdm=False)
    alone = llm.generate([{"prompt_token_ids": prompt}] * 3,
                         [SamplingParams(temperature=1.0, max_tokens=8, seed=5 + i) for i in range(3)], use_tqdm=False)
    assert [c.token_ids for c in forked.outputs] == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(c.token_ids) for c in forked.outputs}) > 1


# triton: the kernel path, whose scan saves the spares (one prompt, whose guesses are partly right)
@pytest.mark.parametrize("backend, prompts", [("torch", slice(0, 6)), ("triton", slice(5, 6))])
def test_guesses_are_taken_back_from_the_state(qwen3_5, backend, prompts):
    """n-gram guesses, from prompts that repeat a prompt after the model's own greedy answer to
    it (so that the guesses are the answer again, some right, some not), with states saved
    every 16 tokens: where some guess of a step is wrong, the state goes back to the one after
    the step's known token and the guesses kept are computed again. Greedy tokens equal
    transformers'."""
    args = {"dtype": "float32", "num_gpu_blocks_override": 64, "max_model_len": 256, "mamba_block_size": 16}
    plain = LLM(str(qwen3_5), **args)
    firsts = [plain.get_tokenizer().encode(p) for p in PROMPTS[prompts]]
    answers = plain.generate([{"prompt_token_ids": ids} for ids in firsts], greedy(24), use_tqdm=False)
    prompts = [ids * 2 + a.outputs[0].token_ids + ids for ids, a in zip(firsts, answers, strict=True)]
    spec = LLM(str(qwen3_5), speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
               num_state_snapshots=8, attention_backend=backend, **args)
    outputs = spec.generate([{"prompt_token_ids": ids} for ids in prompts], greedy(32), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens == hf_greedy_along(qwen3_5, prompts, tokens)
    stats = spec.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, (stats.num_accepted_tokens, stats.num_draft_tokens)
    assert not spec.engine.runner.states.slots


def test_guesses_kept_in_part_are_computed_again_under_new_guesses(qwen3_5):
    """Replies held to three of their prompt's tokens (allowed_token_ids) repeat themselves
    in ways n-gram guesses half foresee, and every token they write is one a guess can follow:
    after some guesses of a step were kept and a later one was not, the next step computes
    the kept ones again and guesses on after them (the spare holds the state after all its
    known rows). Greedy choices among the three equal transformers'."""
    from transformers import AutoModelForCausalLM

    spec = LLM(str(qwen3_5), dtype="float32", num_gpu_blocks_override=64, max_model_len=256, mamba_block_size=16,
               num_state_snapshots=8, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                          "prompt_lookup_max": 2})
    engine = spec.engine
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:6]]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, SamplingParams(
            temperature=0.0, max_tokens=32, ignore_eos=True, allowed_token_ids=ids[:3]))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    guessing_on = 0  # requests whose next step computes kept guesses again, with new guesses after them
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.outputs[0].token_ids
        guessing_on += sum(bool(r.spec_token_ids) and r.num_tokens - r.num_computed_tokens > 1
                           for r in engine.scheduler.running)
    assert guessing_on > 0
    model = AutoModelForCausalLM.from_pretrained(qwen3_5, dtype=torch.float32).eval()
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            out, allowed = tokens[str(i)], torch.tensor(ids[:3])
            logits = model(torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1 :]
            assert out == allowed[logits[:, allowed].argmax(-1)].tolist(), i


def test_kv_offloading_without_saved_states_is_refused_by_name(qwen3_5):
    """No state kept (num_state_snapshots=0) is no prefix cache, which the host tier serves."""
    with pytest.raises(ValueError, match="KV offloading to host memory serves the prefix cache"):
        LLM(str(qwen3_5), dtype="float32", num_gpu_blocks_override=16, max_model_len=128, kv_offloading_size=1.0,
            num_state_snapshots=0)


def test_a_slot_is_taken_zeroed_and_given_back():
    """A request takes a zeroed slot at its first chunk and keeps it while it continues; a
    preempted one gives it back (it starts over); with every slot held, a new request and one
    that continues without its state are errors, not silent mixes of states. One served from
    the prefix cache takes a copy of the saved state it starts from."""
    from worker.model_executor.models.config import LinearAttentionConfig
    from worker.model_executor.models.linear_attention import LinearStates

    states = LinearStates(LinearAttentionConfig(1, 2, 4, 4, 3), 2, 2, torch.float32, torch.device("cpu"))
    assert states.allocate_saved(3, spares=True) == 5  # and a spare per request slot after them
    meta = states.for_step([("a", 0, 5, None, ((4, 2),), 0), ("b", 0, 1, None, (), 0)])
    assert (meta.slots, meta.rows, meta.num_decodes, meta.saves) == ([0, 1], [(0, 5), (5, 6)], 0, [((4, 2),), ()])
    assert not states.recurrent[0].any() and not states.conv[1].any()
    states.recurrent[0].fill_(1.0)
    meta = states.for_step([("b", 1, 1, None, ((2, 0),), 0), ("a", 5, 3, None, (), 0)])
    assert (meta.slots, meta.num_decodes, meta.decode_slots.tolist()) == ([1, 0], 1, [1])
    assert [t.tolist() for t in meta.decode_saves] == [[1], [0]]  # b's slot saved to saved slot 0
    assert states.recurrent[0].eq(1.0).all()  # a's state kept as it continues
    with pytest.raises(RuntimeError, match="no linear-attention state slot is free for request 'c'"):
        states.for_step([("c", 0, 4, None, (), 0)])
    states.saved_recurrent[1].fill_(2.0)
    states.saved_conv[1].fill_(3.0)
    meta = states.for_step([("c", 16, 4, 1, (), 0)], preempted=["a"])
    assert meta.slots == [0] and states.recurrent[0].eq(2.0).all() and states.conv[0].eq(3.0).all()
    with pytest.raises(RuntimeError, match="request 'a' continues at position 8 without"):
        states.for_step([("a", 8, 1, None, (), 0)])
    meta = states.for_step([("c", 20, 3, None, ((21, 1),), 2)])  # a known token and two guesses
    assert meta.saves == [((1, 1), (1, 3))]  # the state after the known token: saved, and in c's spare
    states.saved_recurrent[3].fill_(5.0)
    states.rewind("c")
    assert states.recurrent[0].eq(5.0).all()


def test_a_linear_attention_draft_is_refused(qwen3_5, tiny_family):
    with pytest.raises(ValueError, match=r"the draft model \(Qwen3_5ForCausalLM\) has linear-attention layers"):
        LLM(str(tiny_family("llama")), dtype="float32", num_gpu_blocks_override=16, max_model_len=128,
            speculative_config={"model": str(qwen3_5), "num_speculative_tokens": 2})


@pytest.mark.parametrize("mamba2", [False, True], ids=["gated-deltanet", "mamba2"])
def test_the_kernel_path_steps_as_the_torch_path(mamba2):
    """One layer's steps on the kernel path (the decodes' convolution and every request's rule
    in Triton kernels, under the interpreter here) against the torch path's, from the same
    weights and states: three prompts in chunks, then a step of two decodes beside a chunk,
    with states saved mid-chunk, after a decode, at the same row twice and out of row order
    within a request (the torch path solves the chunks alone, and in the second step, where
    the runs are as many as the rows of the longest, steps through them a token at a time,
    together). Outputs, states and every saved state agree."""
    from worker.model_executor.models.config import LinearAttentionConfig
    from worker.model_executor.models.linear_attention import (
        GatedDeltaNet,
        LinearStates,
        Mamba2Mixer,
    )

    torch.manual_seed(0)
    cfg = LinearAttentionConfig(2, 4, 8, 12, 4, mamba2=mamba2, conv_bias=mamba2)
    mixer = Mamba2Mixer if mamba2 else GatedDeltaNet
    torch_layer, kernel_layer = (mixer(cfg, 32, 1e-6, 1, use_kernels=k).eval() for k in (False, True))
    for param in torch_layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    kernel_layer.load_state_dict(torch_layer.state_dict())
    pools = [LinearStates(cfg, 2, 4, torch.float32, torch.device("cpu")) for _ in range(2)]
    for pool in pools:
        pool.allocate_saved(8)
        pool.saved_conv.fill_(float("nan"))
        pool.saved_recurrent.fill_(float("nan"))
    steps = [
        [("a", 0, 7, None, ((5, 0),), 0), ("b", 0, 20, None, ((16, 1), (3, 2), (16, 3)), 0),
         ("c", 0, 2, None, (), 0)],
        [("c", 2, 1, None, ((3, 4),), 0), ("a", 7, 1, None, (), 0),
         ("b", 20, 3, None, ((21, 5), (23, 6), (21, 7)), 0)],
    ]
    for step in steps:
        x = torch.randn(sum(n for _, _, n, *_ in step), 32)
        with torch.inference_mode():
            outs = [layer(x, None, None, pool.for_step(step)) for layer, pool in zip((torch_layer, kernel_layer), pools,
                                                                                     strict=True)]
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-4)
    for name in ("conv", "recurrent", "saved_conv", "saved_recurrent"):
        theirs, ours = (getattr(pool, name)[:8 if name.startswith("saved") else 3, 1] for pool in pools)  # layer 1's
        assert not theirs.isnan().any(), name
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("offload, tp", [(None, 1), (0.01, 1), (0.01, 2)])
def test_states_evicted_go_on_in_the_host_tier(qwen3_5, offload, tp):
    """Two saved slots on the device: a prompt's states at 16 and 32 are evicted by the
    states of the prompts after it. Without a host tier its follow-up computes everything
    again; with one (kv_offloading_size) they went on in host slots, and the follow-up starts
    from the state at 32, copied back, with the KV blocks of its prefix (on two ranks, each
    copying its heads' part): greedy tokens equal transformers' either way."""
    llm = LLM(str(qwen3_5), dtype="float32", num_gpu_blocks_override=24, max_model_len=128, mamba_block_size=16,
              num_state_snapshots=2, max_num_seqs=1, kv_offloading_size=offload, tensor_parallel_size=tp,
              num_threads=1 if tp > 1 else None)
    engine = llm.engine
    tok = llm.get_tokenizer()
    first = tok.encode(PROMPTS[5])  # 46 tokens: states at 16 and 32 (and 48 as it decodes)
    llm.generate({"prompt_token_ids": first}, greedy(4), use_tqdm=False)
    llm.generate([{"prompt_token_ids": tok.encode(p)} for p in (PROMPTS[8], PROMPTS[7])], greedy(4), use_tqdm=False)
    follow_up = first[:40] + tok.encode(" and then")
    [out] = llm.generate({"prompt_token_ids": follow_up}, greedy(12), use_tqdm=False)
    assert out.num_cached_tokens == (32 if offload else 0)
    assert out.outputs[0].token_ids == hf_greedy_along(qwen3_5, [follow_up], [out.outputs[0].token_ids])[0]
    if offload:
        assert engine.runner.num_host_states > 0 and engine.block_manager.host_states.cached
