"""FP8 checkpoints and fp8 quantization at load, against transformers reading the same
checkpoint (on a CPU it dequantizes fp8 weights as they load: the oracle for what the
stored values and scales mean)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine import check_prefill_logits, check_prefill_logits_against, run_and_compare
from transformers import AutoModelForCausalLM

from worker import LLM
from worker.models.fp8 import FP8, Fp8Linear, quantize

BLOCK = (16, 32)  # rows x columns per scale, off square so a transposed grid shows


def write_fp8_checkpoint(src: Path, out: Path, block: tuple[int, int] | None, keep: tuple[str, ...] = ()) -> Path:
    """`src` with every decoder projection (experts' too) stored in fp8, as FP8 checkpoints
    are: a scale per `block`, or one per tensor (block None); modules under `keep` stay float
    and are listed in modules_to_not_convert."""
    shutil.copytree(src, out)
    tensors = {}
    for name, value in load_file(src / "model.safetensors").items():
        if not name.endswith("proj.weight") or any(name.startswith(k + ".") for k in keep):
            tensors[name] = value
            continue
        q, scale = quantize(value, block or tuple(value.shape))
        tensors[name] = q
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale if block else scale.reshape(())
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block) if block else None,
                                     "modules_to_not_convert": list(keep)}
    (out / "config.json").write_text(json.dumps(config))
    return out


# block scales with the second layer's MLP kept float; experts in fp8 too; one scale per tensor
FP8_CASES = {"llama": ("tiny_llama_dir", BLOCK, ("model.layers.1.mlp",)), "qwen3_moe": ("tiny_qwen3_moe_dir", BLOCK, ()),
             "llama_per_tensor": ("tiny_llama_dir", None, ())}


@pytest.fixture(scope="module", params=list(FP8_CASES))
def fp8_dirs(request, tmp_path_factory) -> tuple[Path, Path]:
    """(the float checkpoint, the same stored in fp8)."""
    fixture, block, keep = FP8_CASES[request.param]
    src = request.getfixturevalue(fixture)
    return src, write_fp8_checkpoint(src, tmp_path_factory.mktemp(request.param) / "fp8", block, keep)


def _hf_last_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1]


def test_fp8_checkpoints_greedy_match_transformers(fp8_dirs):
    _, fp8_dir = fp8_dirs
    run_and_compare(LLM(str(fp8_dir), dtype="float32", num_gpu_blocks_override=256), fp8_dir)


def test_fp8_checkpoints_prefill_logits_match_transformers(fp8_dirs):
    """Both paths: dequantized at load (torch), fp8 weights through the fp8 kernel (triton)."""
    _, fp8_dir = fp8_dirs
    check_prefill_logits(fp8_dir, "torch")
    check_prefill_logits(fp8_dir, "triton")


def test_the_kernel_path_keeps_the_weights_in_fp8_where_the_checkpoint_has_them(fp8_dirs):
    src, fp8_dir = fp8_dirs
    model = LLM(str(fp8_dir), dtype="float32", num_gpu_blocks_override=64, attention_backend="triton",
                enforce_eager=True).engine.runner.model
    keep = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    for i, layer in enumerate(model.layers):
        assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and layer.self_attn.qkv_proj.weight.dtype == FP8
        assert isinstance(layer.self_attn.o_proj, Fp8Linear)
        dense = getattr(layer.mlp, "gate_up_proj", None)
        if dense is not None:  # a dense MLP: fp8 unless the checkpoint keeps it float
            assert isinstance(dense, Fp8Linear) == (f"model.layers.{i}.mlp" not in keep)
        else:  # experts: fp8, with a scale grid per expert
            experts = layer.mlp.experts
            assert experts.w13.dtype == experts.w2.dtype == FP8 and experts.w13_scale.shape[0] == experts.num_experts
    torch_model = LLM(str(fp8_dir), dtype="float32", num_gpu_blocks_override=64).engine.runner.model
    assert not any(isinstance(m, Fp8Linear) for m in torch_model.modules())


def test_quantization_is_visible_in_the_logits(fp8_dirs):
    """The fp8 model is not the float one: the oracle above would not see a loader that
    ignored the scales' layout if the two agreed."""
    src, fp8_dir = fp8_dirs
    ids = list(range(5, 60))
    assert (_hf_last_logits(src, ids) - _hf_last_logits(fp8_dir, ids)).abs().max() > 1e-3


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory, tiny_llama_dir) -> tuple[Path, Path]:
    """(a float Llama, the same with a scale per output channel, as quantization='fp8' makes it)."""
    src = tiny_llama_dir
    out = tmp_path_factory.mktemp("per_channel") / "fp8"
    shutil.copytree(src, out)
    tensors = {}
    for name, value in load_file(src / "model.safetensors").items():
        if name.endswith("proj.weight"):
            value, tensors[name.removesuffix("weight") + "weight_scale_inv"] = quantize(value, (1, value.shape[1]))
        tensors[name] = value
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    (out / "config.json").write_text(json.dumps(config))
    return src, out


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_quantizing_at_load_serves_the_per_channel_fp8_model(llama_dirs, backend):
    """quantization='fp8' over the float checkpoint gives what transformers gives for that
    checkpoint stored with a scale per output channel, on both paths."""
    src, per_channel = llama_dirs
    llm = LLM(str(src), dtype="float32", num_gpu_blocks_override=64, quantization="fp8",
              attention_backend=backend, enforce_eager=True)
    assert any(isinstance(m, Fp8Linear) for m in llm.engine.runner.model.modules()) == (backend == "triton")
    ids = list(range(5, 60))
    out = llm.generate({"prompt_token_ids": ids}, greedy_one(), use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(per_channel, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0, -1].argmax().item()
    assert out.outputs[0].token_ids == [expected]
    runner = llm.engine.runner
    from worker.scheduler import ScheduledRequest, SchedulerOutput

    logits = runner.execute(SchedulerOutput([ScheduledRequest("a", ids, 0, [0, 1, 2, 3], True)])).logits[0].cpu()
    with torch.inference_mode():
        assert torch.allclose(logits, hf(torch.tensor([ids])).logits[0, -1], atol=1e-4, rtol=0)


def greedy_one():
    from producer.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def test_dummy_fp8_weights_are_the_float_ones_quantized(tiny_llama_dir):
    """load_format='dummy' (the GPU check's): the kernel path's fp8 layers hold the dummy
    float weights quantized, so both paths serve the same model."""
    def logits(backend):
        llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, quantization="fp8",
                  load_format="dummy", attention_backend=backend, enforce_eager=True)
        from worker.scheduler import ScheduledRequest, SchedulerOutput

        out = llm.engine.runner.execute(SchedulerOutput([ScheduledRequest("a", list(range(5, 40)), 0, [0, 1, 2], True)]))
        return out.logits[0].cpu()

    torch.testing.assert_close(logits("triton"), logits("torch"), atol=1e-4, rtol=0)


def _rewrite_config(src: Path, out: Path, change) -> Path:
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    change(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("change, error", [
    (lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}), "quantized with 'gptq'"),
    (lambda c: c["quantization_config"].update(fmt="e5m2"), "fp8 format 'e5m2'"),
    (lambda c: c["quantization_config"].update(scale_fmt="ue8m0"), "scale format 'ue8m0'"),
    (lambda c: c["quantization_config"].update(weight_block_size=[128]), "weight_block_size must be two"),
])
def test_quantization_genq_cannot_serve_is_refused_by_name(llama_dirs, tmp_path, change, error):
    bad = _rewrite_config(llama_dirs[1], tmp_path / "bad", change)
    with pytest.raises(ValueError, match=error):
        LLM(str(bad), dtype="float32", num_gpu_blocks_override=64)


def test_a_bad_quantization_argument_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization must be fp8 or None, got 'int4'"):
        LLM(str(tiny_llama_dir), quantization="int4")


@pytest.mark.parametrize("src, block, drop, error", [
    # 48-row blocks do not divide q/k/v's or gate/up's shards: those layers are dequantized at
    # load, their weights waiting for their scales
    ("tiny_llama_dir", (48, 32), "model.layers.0.self_attn.k_proj.weight_scale_inv",
     "fp8 weights without scales: model.layers.0.self_attn.k_proj.weight"),
    ("tiny_llama_dir", (48, 32), "model.layers.1.mlp.up_proj.weight", "scales of no fp8 weight: model.layers.1.mlp.up_proj"),
    # layers kept in fp8 take weight and scales apart
    ("tiny_llama_dir", (48, 32), "model.layers.0.self_attn.o_proj.weight_scale_inv",
     "missing weights: layers.0.self_attn.o_proj.weight_scale"),
    ("tiny_qwen3_moe_dir", BLOCK, "model.layers.0.mlp.experts.2.up_proj.weight_scale_inv",
     "missing weights: layers.0.mlp.experts.w13_scale:up.2"),
])
def test_a_checkpoint_missing_half_a_pair_is_refused_by_name(request, tmp_path, src, block, drop, error):
    bad = write_fp8_checkpoint(request.getfixturevalue(src), tmp_path / "bad", block)
    tensors = load_file(bad / "model.safetensors")
    del tensors[drop]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=error):
        LLM(str(bad), dtype="float32", num_gpu_blocks_override=64)


def test_blocks_that_do_not_divide_the_weights(tiny_llama_dir, tmp_path):
    """48 x 32 blocks: partial blocks at the edges, and fused shards that do not fill whole
    blocks (those layers are dequantized; o_proj and down_proj stay fp8). transformers refuses
    such grids, so the oracle is transformers on the checkpoint dequantized here, block by block."""
    fp8_dir = write_fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", (48, 32))
    dense_dir = tmp_path / "dense"
    shutil.copytree(tiny_llama_dir, dense_dir)
    stored = load_file(fp8_dir / "model.safetensors")
    dense = {}
    for name, value in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if value.dtype == FP8:
            scale = stored[name + "_scale_inv"]
            rows, cols = value.shape
            value = value.float() * torch.stack([torch.stack([scale[r // 48, c // 32] for c in range(cols)])
                                                 for r in range(rows)])
        dense[name] = value
    save_file(dense, dense_dir / "model.safetensors", metadata={"format": "pt"})
    kernel = LLM(str(fp8_dir), dtype="float32", num_gpu_blocks_override=64, attention_backend="triton",
                 enforce_eager=True)
    layer = kernel.engine.runner.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    assert not isinstance(layer.self_attn.qkv_proj, Fp8Linear) and not isinstance(layer.mlp.gate_up_proj, Fp8Linear)
    check_prefill_logits_against(fp8_dir, dense_dir, "torch")
    check_prefill_logits_against(fp8_dir, dense_dir, "triton")


def test_a_float_weight_where_the_checkpoint_promises_fp8_is_refused(llama_dirs, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(llama_dirs[1], bad)
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = torch.randn(tensors[name].shape)
    del tensors[name + "_scale_inv"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.o_proj.weight' is torch.float32, but"):
        LLM(str(bad), dtype="float32", num_gpu_blocks_override=64)
