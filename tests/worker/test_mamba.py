"""Mamba2 layers (worker.model_executor.models.linear_attention.Mamba2Mixer), which keep a state per request
as Qwen3.5's linear attention does: the rule against transformers' own Mamba2 scan, and the
tiny Granite 4.0 models (experts and dense) and Nemotron-H against transformers' greedy
tokens through chunked prefill, preemption and the prefix cache's saved states."""

from __future__ import annotations

import pytest
import torch
from test_engine import PROMPTS, greedy, hf_greedy_along

from worker import LLM
from worker.model_executor.models.linear_attention import gated_delta_rule


@pytest.mark.parametrize("length", [1, 7, 64, 100])
def test_the_rule_without_its_delta_equals_mamba2s_scan(length):
    """q = C, k = B, v = dt x and a log decay of dt A through the chunked rule (beta None), plus
    D x, give transformers' Mamba2 chunk scan's outputs from the same state, its final state
    (transposed: [heads, head_dim, state] there), and the state after the first half."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

    torch.manual_seed(length)
    heads, groups, head_dim, state_size = 4, 2, 8, 6
    x = torch.randn(length, heads, head_dim)
    dt_raw, dt_bias = torch.randn(length, heads), torch.randn(heads)
    a = -torch.rand(heads) * 2 - 0.1
    b, c = torch.randn(2, length, groups, state_size).unbind(0)
    d = torch.randn(heads)
    state = torch.randn(heads, head_dim, state_size)
    expected, expected_state = mamba2_chunk_scan(
        x[None], dt_raw[None], a, b[None], c[None], chunk_size=16, D=d, dt_bias=dt_bias, dt_softplus=True,
        initial_states=state[None].clone(), return_final_states=True)
    dt = torch.nn.functional.softplus(dt_raw + dt_bias)
    bk, cq = (t.repeat_interleave(heads // groups, dim=1) for t in (b, c))
    ours = state.transpose(1, 2).contiguous()
    half = length // 2 + 1
    stop = torch.full_like(ours, float("nan"))
    out = gated_delta_rule(cq, bk, x * dt[..., None], dt * a, None, ours, {half: [stop]}) + d[:, None] * x
    torch.testing.assert_close(out, expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.transpose(1, 2), expected_state[0], atol=1e-4, rtol=1e-4)
    _, expected_stop = mamba2_chunk_scan(
        x[None, :half], dt_raw[None, :half], a, b[None, :half], c[None, :half], chunk_size=16, D=d, dt_bias=dt_bias,
        dt_softplus=True, initial_states=state[None].clone(), return_final_states=True)
    torch.testing.assert_close(stop.transpose(1, 2), expected_stop[0], atol=1e-4, rtol=1e-4)


# each tiny model's Mamba2 layers and attention layers (without RoPE)
# (Nemotron 3 Super's latent experts: tests/worker/test_engine.py's mixtures of experts)
LAYERS = {"granitemoehybrid": ({0, 2}, {1, 3}), "granitemoehybrid_dense": ({0, 2}, {1, 3}), "nemotron_h": ({0, 4}, {2}),
          "nemotron_3": ({0, 4}, {2})}
WITH_EXPERTS = {"granitemoehybrid": None, "nemotron_3": {1, 3}}


def test_granite_4_micro_is_a_plain_transformer(tiny_family):
    """Granite-4.0-Micro's layers are all attention (with RoPE): no state to keep, so nothing
    of the state models' is refused or held back (its prefix cache is the plain one)."""
    model = tiny_family("granitemoehybrid_micro")
    llm = LLM(str(model), dtype="float32", num_gpu_blocks_override=32, max_model_len=128)
    engine = llm.engine
    assert engine.model_config.linear is None and not engine.model_config.nope_layers and engine.runner.states is None
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], greedy(16), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens == hf_greedy_along(model, prompts, tokens)


@pytest.mark.parametrize("family", list(LAYERS))
def test_mamba2_hybrids_greedy_match_transformers(tiny_family, family):
    """Granite 4.0 (experts, and dense), Nemotron-H (a layer each for Mamba2, attention and
    the MLP) and Nemotron 3 (two of its MLPs layers of experts, as Nano's): six prompts at once in chunks of 24 tokens, in a pool small enough that
    some are preempted, then a prompt going on from a finished one (its state saved every 16
    tokens): greedy tokens equal transformers' throughout, the last served from the cache."""
    model = tiny_family(family)
    llm = LLM(str(model), dtype="float32", num_gpu_blocks_override=10, max_num_batched_tokens=24, max_model_len=128,
              mamba_block_size=16, num_state_snapshots=16)
    engine = llm.engine
    assert (engine.model_config.linear_layers, engine.model_config.nope_layers) == LAYERS[family]
    moe = engine.model_config.moe
    assert (moe is None) == (family not in WITH_EXPERTS)
    assert moe is None or WITH_EXPERTS[family] in (None, moe.layers)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:6]]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], greedy(32), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens == hf_greedy_along(model, prompts, tokens)
    assert engine.scheduler.num_preemptions > 0
    follow_up = prompts[5] + tokens[5] + tok.encode(" What else?")
    [out] = llm.generate({"prompt_token_ids": follow_up}, greedy(16), use_tqdm=False)
    assert out.num_cached_tokens == (len(prompts[5]) + 31) // 16 * 16
    assert out.outputs[0].token_ids == hf_greedy_along(model, [follow_up], [out.outputs[0].token_ids])[0]

