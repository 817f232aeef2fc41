"""Speculative decoding with an EAGLE-3 head (`speculative_config={"method": "eagle3", "model":
DIR}`): every guess is the one a plain-torch EAGLE-3 head makes (written here from the
published architecture, as SpecForge trains it and vLLM runs it) over transformers' hidden
states of the target, and outputs stay plain decoding's.

The head is written as SpecForge saves one (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`,
`t2d`) or as the speculators library does (`layers.0.*`, its config nested, its states
normed before they are the residual), with random weights and a draft vocabulary of a few
hundred of the target's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_mtp import PROMPTS, run_checking_guesses
from transformers import AutoModelForCausalLM

from producer.sampling_params import SamplingParams
from worker import LLM

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, DRAFT_VOCAB, VOCAB = 64, 4, 2, 16, 96, 300, 49152
AUX = [0, 1, 1]  # the tiny target has two layers: its embeddings, and the input of its second layer twice


def build_eagle3_head(out: Path, own_embedding: bool = False, aux: list[int] | None = AUX,
                      speculators: dict | None = None) -> Path:
    """SpecForge's layout; with `speculators`, the speculators library's, these fields added
    to its config."""
    generator = torch.Generator().manual_seed(3)

    def rand(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    def norm() -> torch.Tensor:
        return torch.rand(HIDDEN, generator=generator) + 0.5

    targets = torch.randperm(VOCAB, generator=generator)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[targets] = True
    tensors = {
        "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(), "norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, 2 * HIDDEN, std=0.3),
        "midlayer.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN, std=0.3),
        "midlayer.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN, std=0.3),
        "midlayer.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM, std=0.3),
        "midlayer.mlp.gate_proj.weight": rand(INTER, HIDDEN), "midlayer.mlp.up_proj.weight": rand(INTER, HIDDEN),
        "midlayer.mlp.down_proj.weight": rand(HIDDEN, INTER), "fc.weight": rand(HIDDEN, 3 * HIDDEN),
        "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN, std=1.0), "d2t": targets - torch.arange(DRAFT_VOCAB), "t2d": t2d,
    }
    if own_embedding:
        tensors["embed_tokens.weight"] = rand(VOCAB, HIDDEN, std=1.0)
    out.mkdir(parents=True)
    layer = {"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTER, "num_attention_heads": HEADS,
             "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_hidden_layers": 1, "vocab_size": VOCAB,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
             "tie_word_embeddings": False, "hidden_act": "silu"}
    if speculators is None:
        config = {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": DRAFT_VOCAB}
        if aux is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True}
    else:
        tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
        config = {"architectures": ["Eagle3Speculator"], "model_type": "speculators",
                  "speculators_model_type": "eagle3", "draft_vocab_size": DRAFT_VOCAB, "transformer_layer_config": layer,
                  "eagle_aux_hidden_state_layer_ids": aux, "target_hidden_size": None,
                  "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                      {"proposal_type": "greedy", "speculative_tokens": 3}],
                      "verifier": {"name_or_path": "target", "architectures": ["LlamaForCausalLM"]}},
                  **speculators}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


class TorchEagle3:
    """The head in plain torch over transformers' target: the guesses `HfMtp.guesses` makes
    for an MTP layer, for this head (run_checking_guesses reads them)."""

    def __init__(self, target_dir: Path, head_dir: Path, norm_before_residual: bool = False):
        from safetensors.torch import load_file

        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.w = {k.replace("layers.0.", "midlayer."): v for k, v in load_file(head_dir / "model.safetensors").items()}
        self.norm_before_residual = norm_before_residual
        self.embed = self.w.get("embed_tokens.weight", self.target.model.embed_tokens.weight.detach())

    @staticmethod
    def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    @staticmethod
    def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [n, heads, d]: Llama's half split
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
        angles = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)[:, None]  # [n, 1, d]
        half = torch.cat([-x[..., HEAD_DIM // 2 :], x[..., : HEAD_DIM // 2]], dim=-1)
        return x * angles.cos() + half * angles.sin()

    given: torch.Tensor | None = None  # a prompt given as embeddings: its first positions' inputs

    def _inputs(self, ids: list[int], embed: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """The rows' input embeddings; positions `offset` on, the given ones where they reach."""
        rows = embed[ids].clone()
        if self.given is not None and offset < len(self.given):
            reach = min(len(self.given) - offset, len(ids))
            rows[:reach] = self.given[offset : offset + reach]
        return rows

    def _layer(self, ids: list[int], states: torch.Tensor) -> torch.Tensor:  # -> [n, hidden] before the last norm
        w, n = self.w, len(ids)
        normed = self._rms(states, w["midlayer.hidden_norm.weight"])
        x = torch.cat([self._rms(self._inputs(ids, self.embed, 1), w["midlayer.input_layernorm.weight"]), normed], dim=-1)
        positions = torch.arange(n)
        q = self._rotate((x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), positions)
        k = self._rotate((x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), positions)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HEADS * HEAD_DIM)
        residual = (normed if self.norm_before_residual else states) + o @ w["midlayer.self_attn.o_proj.weight"].T
        y = self._rms(residual, w["midlayer.post_attention_layernorm.weight"])
        mlp = (torch.nn.functional.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T))
        return residual + mlp @ w["midlayer.mlp.down_proj.weight"].T

    @torch.inference_mode()
    def guesses(self, token_ids: list[int], num: int) -> tuple[list[int], torch.Tensor]:
        target_inputs = self._inputs(token_ids[:-1], self.target.model.embed_tokens.weight.detach())
        hidden = self.target(inputs_embeds=target_inputs[None], output_hidden_states=True).hidden_states
        states = torch.cat([hidden[i][0] for i in AUX], dim=-1) @ self.w["fc.weight"].T
        ids, guesses, first = list(token_ids[1:]), [], None
        for _ in range(num):
            out = self._layer(ids, states)
            logits = self._rms(out[-1], self.w["norm.weight"]) @ self.w["lm_head.weight"].T
            draft = int(logits.argmax())
            guesses.append(draft + int(self.w["d2t"][draft]))
            first = out[-1] if first is None else first
            ids.append(guesses[-1])
            states = torch.cat([states, out[-1:]])
        assert first is not None
        return guesses, first


@pytest.mark.parametrize(("own_embedding", "backend"), [(False, "torch"), (True, "torch"), (False, "triton")])
def test_eagle3_guesses_are_the_heads_and_outputs_plain_decodings(tiny_llama_dir, tmp_path, own_embedding, backend):
    """Step by step, with prompts prefilled over several steps, each running request's guesses
    are the head's from its tokens so far (its draft tokens mapped to the target's), with the
    target's embedding or its own, on the torch path and the kernel path (whose fused norms
    add into the residual stream in place: the states kept are copies); outputs are the
    target's greedy ones."""
    head = build_eagle3_head(tmp_path / "head", own_embedding)
    args = dict(dtype="float32", num_gpu_blocks_override=64, max_model_len=128, max_num_batched_tokens=16,
                enable_prefix_caching=False, attention_backend=backend)
    spec = LLM(str(tiny_llama_dir), speculative_config={"method": "eagle3", "model": str(head),
                                                        "num_speculative_tokens": 3}, **args)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = run_checking_guesses(spec, TorchEagle3(tiny_llama_dir, head), PROMPTS, greedy)
    plain = LLM(str(tiny_llama_dir), **args).generate([{"prompt_token_ids": p} for p in PROMPTS], greedy,
                                                      use_tqdm=False)
    assert outputs == [o.outputs[0].token_ids for o in plain]


def test_eagle3_with_a_cached_prefix_and_siblings(tiny_llama_dir, tmp_path):
    """The head's cache mirrors the target's blocks as the MTP layer's does."""
    head = build_eagle3_head(tmp_path / "head")
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})
    shared = PROMPTS[0] + PROMPTS[1]
    run_checking_guesses(llm, TorchEagle3(tiny_llama_dir, head), [shared, shared[:32] + [5, 6, 7, 8, 9]],
                         SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True))
    assert llm.engine.block_manager.stats.hits >= 32


def test_what_is_not_an_eagle3_head_is_refused_by_name(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="needs an EAGLE-3 head .* holds LlamaForCausalLM"):
        LLM(str(tiny_llama_dir), num_gpu_blocks_override=16, max_model_len=128,
            speculative_config={"method": "eagle3", "model": str(tiny_llama_dir), "num_speculative_tokens": 2})
    head = build_eagle3_head(tmp_path / "head", aux=None)  # its default layers, 2, 1 and -1, are not the target's
    with pytest.raises(ValueError, match=r"reads the target's layers \(2, 1, -1\): three of its 2 are needed"):
        LLM(str(tiny_llama_dir), num_gpu_blocks_override=16, max_model_len=128,
            speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})


@pytest.mark.parametrize("norm_before_residual", [True, False])
def test_a_speculators_head_guesses_as_its_config_says(tiny_llama_dir, tmp_path, norm_before_residual):
    """Red Hat's speculators layout: the layer under `layers.0.`, its config nested, the
    states normed before they are the residual unless the config says otherwise. Given as a
    draft `model` without a method, it is read as the head it is (as vLLM reads it)."""
    head = build_eagle3_head(tmp_path / "head", speculators={"norm_before_residual": norm_before_residual})
    args = dict(dtype="float32", num_gpu_blocks_override=64, max_model_len=128, max_num_batched_tokens=16)
    spec = LLM(str(tiny_llama_dir), speculative_config={"model": str(head), "num_speculative_tokens": 3}, **args)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = run_checking_guesses(spec, TorchEagle3(tiny_llama_dir, head, norm_before_residual), PROMPTS, greedy)
    plain = LLM(str(tiny_llama_dir), **args).generate([{"prompt_token_ids": p} for p in PROMPTS], greedy,
                                                      use_tqdm=False)
    assert outputs == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize(("fields", "error"), [
    ({"speculators_model_type": "eagle"}, "holds a speculators 'eagle' model; genq serves its eagle3 heads only"),
    ({"norm_before_fc": True}, "sets norm_before_fc, a normalization genq does not run"),
    ({"transformer_layer_config": {"model_type": "qwen3"}}, "needs a Llama transformer_layer_config"),
])
def test_speculators_heads_genq_cannot_run_are_refused_by_name(tiny_llama_dir, tmp_path, fields, error):
    head = build_eagle3_head(tmp_path / "head", speculators=fields)
    with pytest.raises(ValueError, match=error):
        LLM(str(tiny_llama_dir), num_gpu_blocks_override=16, max_model_len=128,
            speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})


def test_a_prompt_given_as_embeddings_feeds_the_head_them_too(tiny_llama_dir, tmp_path):
    """As the MTP layer's: the head's rows of a prompt given as embeddings read them."""
    head = build_eagle3_head(tmp_path / "head")
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
              max_num_batched_tokens=16,
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})
    oracle = TorchEagle3(tiny_llama_dir, head)
    with torch.no_grad():
        oracle.given = oracle.target.model.embed_tokens(torch.tensor(PROMPTS[0])) * 1.5
    run_checking_guesses(llm, oracle, [{"prompt_embeds": oracle.given}],
                         SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
