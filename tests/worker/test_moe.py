"""Mixtures of experts beyond greedy parity (tests/worker/test_engine.py has that): the expert
layers' bfloat16 arithmetic, both checkpoint layouts, and LoRA beside experts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine import check_prefill_logits_against
from test_quantization import write_fp8_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

from producer.sampling_params import SamplingParams
from worker import LLM, LoRARequest
from worker.model_executor.model_loader import iter_safetensors
from worker.model_executor.models.config import ModelConfig
from worker.model_executor.models.llama import LlamaForCausalLM
from worker.model_executor.models.moe import SparseMoeBlock, pack_experts
from worker.model_executor.models.packed_linear import can_pack, pack_linears


def _load(model_dir: Path, dtype: torch.dtype) -> LlamaForCausalLM:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = LlamaForCausalLM(ModelConfig.from_hf(hf.config))
    model.load_weights(iter_safetensors(model_dir))
    return model.to(dtype).eval()


def _hf_block(block, x: torch.Tensor) -> torch.Tensor:
    out = block(x[None])
    # gpt-oss's and Llama 4's also return their router's scores (Llama 4's output is flat)
    return (out[0] if isinstance(out, tuple) else out).reshape(x.shape)


def test_expert_layers_equal_transformers_bitwise_in_bfloat16(tiny_moe_dir):
    """Routing, each expert's rounding, Mixtral's float32 weights against Qwen's rounded
    ones, the shared expert: the MoE block's output equals transformers', bit for bit, over
    a batch of tokens that routes to every expert (and so with packed CPU linears)."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.bfloat16).eval()
    ours = _load(tiny_moe_dir, torch.bfloat16)
    if hf.config.model_type == "minimax_m2":  # genq keeps its router in float32 (as vLLM, and as
        # transformers keeps DeepSeek-V3's); transformers rounds it with the model: given back here
        full = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
        for block, whole in zip(hf.model.layers, full.model.layers, strict=True):
            block.mlp.gate.weight.data = whole.mlp.gate.weight.data
            block.mlp.e_score_correction_bias.data = whole.mlp.e_score_correction_bias.data
    torch.manual_seed(0)
    x = torch.randn(57, hf.config.hidden_size).to(torch.bfloat16)
    moe_layers = [i for i, layer in enumerate(ours.layers) if isinstance(getattr(layer, "mlp", None), SparseMoeBlock)]
    assert moe_layers
    with torch.inference_mode():
        hf_layers = hf.model.layers
        expected = {i: next(getattr(hf_layers[i], name) for name in ("mlp", "feed_forward", "block_sparse_moe", "mixer")
                            if hasattr(hf_layers[i], name)) for i in moe_layers}
        expected = {i: _hf_block(block, x) for i, block in expected.items()}
        ids = {i: ours.layers[i].mlp.route(x)[1] for i in moe_layers}
        assert all(len(ids[i].unique()) == ours.config.moe.num_experts for i in moe_layers)
        for i in moe_layers:
            assert torch.equal(ours.layers[i].mlp(x), expected[i]), i
        if can_pack(torch.device("cpu"), torch.bfloat16):
            pack_linears(ours, batch_hint=8)
            assert pack_experts(ours, batch_hint=8) == len(moe_layers)
            for i in moe_layers:
                assert torch.equal(ours.layers[i].mlp(x), expected[i]), i


def test_stacked_experts_load_like_one_tensor_per_expert(tiny_moe_dir, tmp_path):
    """transformers >= 5 holds each layer's experts as two stacked tensors; a checkpoint saved
    from that state dict loads to the same weights as the hub's one-tensor-per-expert files."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()
             if not (hf.config.tie_word_embeddings and k == "lm_head.weight")}
    assert any(k.endswith(("experts.gate_up_proj", "experts.up_proj")) for k in state)  # (up alone: Nemotron 3's)
    for path in tiny_moe_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, tmp_path / path.name)
    save_file(state, tmp_path / "model.safetensors")
    per_expert, stacked = _load(tiny_moe_dir, torch.float32), _load(tmp_path, torch.float32)
    for (name, a), (_, b) in zip(per_expert.named_parameters(), stacked.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_missing_expert_is_named(tiny_qwen3_moe_dir, tmp_path):
    for path in tiny_qwen3_moe_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, tmp_path / path.name)
    tensors = load_file(tiny_qwen3_moe_dir / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"checkpoint is missing weights: layers\.0\.mlp\.experts\.w13:up\.3"):
        LLM(str(tmp_path), dtype="float32", num_gpu_blocks_override=16)


def test_lora_adapts_attention_and_dense_layers_beside_experts(tiny_qwen3_moe_dir, default_model_dir, tmp_path):
    """An adapter on attention projections and on the MLP of layer 1 (the dense one) gives the
    tokens of transformers on the weights with the adapter merged in; one that adapts layer
    0's MLP, where the experts are, is refused by name."""
    cfg = json.loads((tiny_qwen3_moe_dir / "config.json").read_text())
    hidden, dense, q_out = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"] * cfg["head_dim"]
    shapes = {"0.self_attn.q_proj": (hidden, q_out), "1.self_attn.v_proj": (hidden, cfg["num_key_value_heads"] * cfg["head_dim"]),
              "1.mlp.gate_proj": (hidden, dense), "1.mlp.down_proj": (dense, hidden)}
    rank, alpha = 4, 8
    torch.manual_seed(5)
    pairs = {name: (torch.randn(rank, fan_in) * 0.3, torch.randn(fan_out, rank) * 0.3)
             for name, (fan_in, fan_out) in shapes.items()}
    adapter = _write_adapter(tmp_path / "adapter", pairs, rank, alpha)
    merged = tmp_path / "merged"
    shutil.copytree(tiny_qwen3_moe_dir, merged)
    weights = load_file(merged / "model.safetensors")
    for name, (a, b) in pairs.items():
        weights[f"model.layers.{name}.weight"] += (alpha / rank) * b @ a
    save_file(weights, merged / "model.safetensors")

    prompts = ["Hello, my name is", "The quick brown fox jumps over the lazy dog. " * 3]
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = [hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(ids):].tolist() for ids in map(tok.encode, prompts)]
    llm = LLM(str(tiny_qwen3_moe_dir), dtype="float32", num_gpu_blocks_override=64, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=LoRARequest("moe", 1, str(adapter)), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    base = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in base] != expected  # the adapter changed something

    bad = _write_adapter(tmp_path / "bad", {"0.mlp.gate_proj": (torch.zeros(rank, hidden), torch.zeros(dense, rank))},
                         rank, alpha)
    with pytest.raises(ValueError, match=r"adapts the MLP of layer 0, a mixture-of-experts layer"):
        llm.generate(prompts[:1], params, lora_request=LoRARequest("bad", 2, str(bad)), use_tqdm=False)


def _write_adapter(out: Path, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, alpha: int) -> Path:
    """A PEFT LoRA directory as PEFT writes one: `<layer>.<module>` -> (A [r, in], B [out, r])."""
    out.mkdir()
    targets = sorted({name.rsplit(".", 1)[1] for name in pairs})
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "bias": "none"}))
    tensors = {}
    for name, (a, b) in pairs.items():
        tensors[f"base_model.model.model.layers.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.model.layers.{name}.lora_B.weight"] = b.contiguous()
    save_file(tensors, out / "adapter_model.safetensors")
    return out


@pytest.mark.parametrize("tiny_moe_dir", ["glm4_moe", "minimax_m2"], indirect=True)
def test_multi_token_prediction_layers_are_left_unloaded(tiny_moe_dir, tmp_path):
    """GLM-4.5's and DeepSeek-V3's checkpoints hold their multi-token-prediction layer after
    the decoder's (its config's num_nextn_predict_layers; MiniMax-M2's, use_mtp and
    num_mtp_modules): genq loads the rest; a layer past that is still refused by name."""
    for path in tiny_moe_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, tmp_path / path.name)
    config = json.loads((tmp_path / "config.json").read_text())
    if config["model_type"] == "minimax_m2":
        (tmp_path / "config.json").write_text(json.dumps({**config, "use_mtp": True, "num_mtp_modules": 1}))
    tensors = load_file(tiny_moe_dir / "model.safetensors")
    layers = json.loads((tiny_moe_dir / "config.json").read_text())["num_hidden_layers"]
    mtp = {f"model.layers.{layers}.eh_proj.weight": torch.ones(64, 128),
           f"model.layers.{layers}.self_attn.q_proj.weight": torch.ones(64, 64)}
    save_file({**tensors, **mtp}, tmp_path / "model.safetensors")
    plain, with_mtp = _load(tiny_moe_dir, torch.float32), _load(tmp_path, torch.float32)
    for (name, a), (_, b) in zip(plain.named_parameters(), with_mtp.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    save_file({**tensors, f"model.layers.{layers + 1}.eh_proj.weight": torch.ones(64, 128)},
              tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"checkpoint tensor 'model\.layers\.{layers + 1}\.eh_proj\.weight' has no place"):
        _load(tmp_path, torch.float32)


def test_llama4_weighs_each_experts_input_with_two_experts_a_token(tiny_family, tmp_path):
    """Llama 4 routes one expert a token, scaling the token going in by the sigmoid of its
    logit; with two a token each pair's input is scaled by its own weight and the pairs'
    outputs are summed unweighted, as transformers' block does."""
    shutil.copytree(tiny_family("llama4"), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 2}))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = _load(tmp_path, torch.float32)
    torch.manual_seed(0)
    x = torch.randn(40, hf.config.hidden_size)
    with torch.inference_mode():
        expected = _hf_block(hf.model.layers[0].feed_forward, x)
        block = ours.layers[0].mlp
        weights, ids = block.route(x)
        assert ids.shape == (40, 2)
        torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-5)
        # not the experts' outputs weighed: the scale goes in before their nonlinearity
        assert not torch.allclose(block.experts(x, weights, ids) + block.shared_expert(x), expected, atol=1e-4)


@pytest.mark.parametrize(("change", "error"), [
    ({"qk_norm_type": "per_head"}, r"qk_norm_type='per_head' are not supported; genq runs qk_norm_type='per_layer'"),
    ({"scoring_func": "softmax"}, r"scoring_func='softmax' are not supported"),
    ({"shared_intermediate_size": 32}, r"shared_intermediate_size=32 are not supported"),
    ({"attn_type_list": [0, 1]}, r"makes layers \[0\] lightning \(linear\) attention, MiniMax-Text-01's"),
])
def test_minimax_configs_of_another_model_are_refused_by_name(change, error):
    """MiniMax-M2's checkpoints carry MiniMax-Text-01's config fields, which transformers'
    MiniMaxM2 does not read: values other than M2's describe a model genq would run wrongly."""
    from transformers import MiniMaxM2Config

    config = MiniMaxM2Config(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, num_local_experts=4, vocab_size=512,
                             bos_token_id=1, eos_token_id=2, architectures=["MiniMaxM2ForCausalLM"])
    assert ModelConfig.from_hf(config).moe.sigmoid_scores  # as given, M2's values
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=error):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize("tiny_moe_dir", ["minimax_m2"], indirect=True)
def test_minimax_fp8_block_checkpoints_load_as_minimax_ships_them(tiny_moe_dir, tmp_path):
    """MiniMax-M2 ships in fp8 with a scale per 128 x 128 block (16 x 16 here: whole blocks,
    as its widths make), its experts' w1, w2 and w3 too, its router and the LM head float
    (modules_to_not_convert names them bare): the logits are transformers' on the same
    checkpoint, on both paths, the kernel path's experts in fp8."""
    fp8_dir = write_fp8_checkpoint(tiny_moe_dir, tmp_path / "fp8", (16, 16))
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["gate", "e_score_correction_bias", "lm_head"]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    for backend in ("torch", "triton"):
        llm = check_prefill_logits_against(fp8_dir, fp8_dir, backend)
    experts = llm.engine.runner.model.layers[0].mlp.experts
    assert experts.w13.dtype == experts.w2.dtype == torch.float8_e4m3fn
