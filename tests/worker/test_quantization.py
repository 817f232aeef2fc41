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
from worker.core.scheduler import ScheduledRequest, SchedulerOutput
from worker.model_executor.models.quant import FP8, QuantLinear, pack_int4, quantize, unpack

BLOCK = (16, 32)  # rows x columns per scale, off square so a transposed grid shows


FLOAT8_WEIGHTS = ("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")  # (Mixtral's experts are w1, w2, w3)


def write_fp8_checkpoint(src: Path, out: Path, block: tuple[int, int] | None, keep: tuple[str, ...] = ()) -> Path:
    """`src` with every decoder projection (experts' too) stored in fp8, as FP8 checkpoints
    are: a scale per `block`, or one per tensor (block None); modules under `keep` stay float
    and are listed in modules_to_not_convert."""
    shutil.copytree(src, out)
    tensors = {}
    for name, value in load_file(src / "model.safetensors").items():
        if not name.endswith(FLOAT8_WEIGHTS) or any(name.startswith(k + ".") for k in keep):
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
    """Both paths: dequantized at load (torch), fp8 weights through the fp8 kernels (triton;
    a per-tensor scale reaches them as the per-channel grid quantizing at load makes, tested
    below, so that case runs the torch path only)."""
    _, fp8_dir = fp8_dirs
    check_prefill_logits(fp8_dir, "torch")
    if json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["weight_block_size"]:
        check_prefill_logits(fp8_dir, "triton")


def test_the_kernel_path_keeps_the_weights_in_fp8_where_the_checkpoint_has_them(fp8_dirs):
    src, fp8_dir = fp8_dirs
    model = LLM(str(fp8_dir), dtype="float32", num_gpu_blocks_override=64, attention_backend="triton",
                enforce_eager=True).engine.runner.model
    keep = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    for i, layer in enumerate(model.layers):
        assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and layer.self_attn.qkv_proj.weight.dtype == FP8
        assert isinstance(layer.self_attn.o_proj, QuantLinear)
        dense = getattr(layer.mlp, "gate_up_proj", None)
        if dense is not None:  # a dense MLP: fp8 unless the checkpoint keeps it float
            assert isinstance(dense, QuantLinear) == (f"model.layers.{i}.mlp" not in keep)
        else:  # experts: fp8, with a scale grid per expert
            experts = layer.mlp.experts
            assert experts.w13.dtype == experts.w2.dtype == FP8 and experts.w13_scale.shape[0] == experts.num_experts
    torch_model = LLM(str(fp8_dir), dtype="float32", num_gpu_blocks_override=64).engine.runner.model
    assert not any(isinstance(m, QuantLinear) for m in torch_model.modules())


def test_quantization_is_visible_in_the_logits(fp8_dirs):
    """The fp8 model is not the float one: the oracle above would not see a loader that
    ignored the scales' layout if the two agreed."""
    src, fp8_dir = fp8_dirs
    ids = list(range(5, 60))
    assert (_hf_last_logits(src, ids) - _hf_last_logits(fp8_dir, ids)).abs().max() > 1e-3


def write_per_channel_checkpoint(src: Path, out: Path) -> Path:
    """`src` with its projections in fp8, a scale per output channel, as quantization='fp8'
    quantizes them at load."""
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
    return out


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen3_moe_dir"])
def per_channel_dirs(request, tmp_path_factory) -> tuple[Path, Path]:
    """(a float model, the same with a scale per output channel, as quantization='fp8' makes it)."""
    src = request.getfixturevalue(request.param)
    return src, write_per_channel_checkpoint(src, tmp_path_factory.mktemp("per_channel") / "fp8")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_quantizing_at_load_serves_the_per_channel_fp8_model(per_channel_dirs, backend):
    """quantization='fp8' over the float checkpoint gives what transformers gives for that
    checkpoint stored with a scale per output channel, on both paths (experts included)."""
    src, per_channel = per_channel_dirs
    llm = LLM(str(src), dtype="float32", num_gpu_blocks_override=64, quantization="fp8",
              attention_backend=backend, enforce_eager=True)
    model = llm.engine.runner.model
    assert any(isinstance(m, QuantLinear) for m in model.modules()) == (backend == "triton")
    ids = list(range(5, 60))
    logits = llm.engine.runner.execute(SchedulerOutput([ScheduledRequest("a", ids, 0, [0, 1, 2, 3], True)])).logits
    assert torch.allclose(logits[0].cpu(), _hf_last_logits(per_channel, ids), atol=1e-4, rtol=0)


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize("quantized", ["fp8 at load", "AWQ checkpoint"])
def test_dummy_quantized_weights_are_the_float_ones_quantized(tiny_llama_dir, tmp_path, quantized):
    """load_format='dummy' (the GPU check's): the kernel path's quantized layers hold the
    dummy float weights quantized (their spread the initializer's), so both paths serve the
    same model (int4 with zero points: zero)."""
    model_dir, extra = tiny_llama_dir, {"quantization": "fp8"}
    if quantized == "AWQ checkpoint":
        model_dir, extra = _rewrite_config(tiny_llama_dir, tmp_path / "awq",
                                           lambda c: c.update(quantization_config=AWQ_CONFIG)), {}

    def run(backend):
        llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64, load_format="dummy",
                  attention_backend=backend, enforce_eager=True, **extra)
        step = SchedulerOutput([ScheduledRequest("a", list(range(5, 40)), 0, [0, 1, 2], True)])
        return llm.engine.runner.model, llm.engine.runner.execute(step).logits[0].cpu()

    (kernel_model, kernel), (torch_model, plain) = run("triton"), run("torch")
    assert isinstance(kernel_model.layers[0].mlp.down_proj, QuantLinear)
    assert (kernel_model.layers[0].mlp.down_proj.weight_zero is not None) == (quantized == "AWQ checkpoint")
    down = torch_model.layers[0].mlp.down_proj  # dequantized at load (and packed for oneDNN)
    std = down(torch.eye(down.in_features)).std().item()  # its outputs for the unit vectors: the weight
    assert 0.25 < std < 0.35, std  # initializer_range 0.3
    torch.testing.assert_close(kernel, plain, atol=1e-4, rtol=0)


def write_compressed_tensors_checkpoint(src: Path, out: Path, strategy: str) -> Path:
    """`src` as llm-compressor stores an FP8 model in compressed-tensors' format: each
    projection's fp8 weight and `weight_scale` (per tensor, per output channel, or per 16 x 32
    block), activations quantized dynamically per token (a setting genq does not read); the
    second layer's MLP left float by an `re:` ignore pattern."""
    shutil.copytree(src, out)
    tensors = {}
    for name, value in load_file(src / "model.safetensors").items():
        if name.endswith("proj.weight") and ".layers.1.mlp." not in name:
            block = {"tensor": tuple(value.shape), "channel": (1, value.shape[1]), "block": BLOCK}[strategy]
            value, scale = quantize(value, block)
            tensors[name.removesuffix("weight") + "weight_scale"] = scale.reshape(1) if strategy == "tensor" else scale
        tensors[name] = value
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
               "block_structure": list(BLOCK) if strategy == "block" else None}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head", "re:.*layers[.]1[.]mlp[.].*"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}}}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_compressed_tensors_fp8_checkpoints_match_transformers(tiny_llama_dir, tmp_path, strategy):
    """The oracle: transformers with the compressed-tensors package, dequantizing the weights
    (as genq serves them: activations are not quantized)."""
    from transformers import CompressedTensorsConfig

    ct_dir = write_compressed_tensors_checkpoint(tiny_llama_dir, tmp_path / strategy, strategy)
    # the kernels see the same scale grids as for transformers' fp8 format: one strategy suffices there
    for backend in ("torch", "triton") if strategy == "block" else ("torch",):
        check_prefill_logits_against(ct_dir, ct_dir, backend, quantization_config=CompressedTensorsConfig(dequantize=True))
    model = LLM(str(ct_dir), dtype="float32", num_gpu_blocks_override=64, attention_backend="triton",
                enforce_eager=True).engine.runner.model
    assert isinstance(model.layers[0].mlp.down_proj, QuantLinear) and isinstance(model.layers[1].self_attn.o_proj, QuantLinear)
    assert not isinstance(model.layers[1].mlp.down_proj, QuantLinear)  # ignored: stored float


def write_modelopt_checkpoint(src: Path, out: Path, oracle: Path, exclude: list[str], apart: bool = False) -> None:
    """`src` as NVIDIA ModelOpt stores FP8 (its quantization_config, or with `apart` its
    hf_quant_config.json alone): each projection (experts' too) fp8 with a float32
    `weight_scale` per tensor and an `input_scale`, those that `exclude` names (patterns too)
    float, a KV-cache scale on each k_proj and v_proj; and at `oracle` the float checkpoint
    those fp8 values and scales make, for transformers."""
    import fnmatch

    shutil.copytree(src, out)
    shutil.copytree(src, oracle)
    tensors, dense = {}, {}
    for name, value in load_file(src / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if name.endswith("proj.weight") and not any(fnmatch.fnmatch(module, p) or module == p for p in exclude):
            q, scale = quantize(value, tuple(value.shape))  # one scale for the tensor
            tensors[name], tensors[module + ".weight_scale"] = q, scale.reshape(())
            tensors[module + ".input_scale"] = torch.tensor(0.5)  # (static activation scales: not read)
            value = q.float() * scale
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[f"{module}.{name.split('.')[-2][0]}_scale"] = torch.tensor(0.25 if "k_proj" in name else 0.125)
        tensors.setdefault(name, value)
        dense[name] = value
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    save_file(dense, oracle / "model.safetensors", metadata={"format": "pt"})
    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head", *exclude]}
    if apart:
        (out / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}))
    else:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "modelopt", **quant}
        (out / "config.json").write_text(json.dumps(config))


# attention's first layer kept float by a pattern, the second MLP by name; experts in fp8 too,
# from hf_quant_config.json; Nemotron 3 as NVIDIA's recipe keeps it (its one attention layer
# float, named as its checkpoint names it; Mamba2's projections and the experts fp8)
@pytest.mark.parametrize("model, apart, exclude", [
    ("tiny_llama_dir", False, ["model.layers.0.self_attn*", "model.layers.1.mlp"]),
    ("tiny_qwen3_moe_dir", True, ["model.layers.0.self_attn*", "model.layers.1.mlp"]),
    ("nemotron_3", False, ["backbone.layers.2.mixer*"])])
def test_modelopt_fp8_checkpoints_match_transformers(request, tiny_family, tmp_path, model, apart, exclude):
    """NVIDIA's FP8 checkpoints: against transformers on the float weights their fp8 values
    and scales make, on both paths; the layers ModelOpt excluded stay float on the kernel
    path, the others fp8; the KV-cache scales on k_proj and v_proj serve an fp8 cache."""
    src = tiny_family(model) if model.startswith("nemotron") else request.getfixturevalue(model)
    write_modelopt_checkpoint(src, tmp_path / "q", tmp_path / "oracle", exclude, apart)
    for backend in ("torch", "triton"):
        check_prefill_logits_against(tmp_path / "q", tmp_path / "oracle", backend)
    if model.startswith("nemotron"):  # its fp8 Mamba2 and expert layers split over two ranks, by heads and features
        check_prefill_logits_against(tmp_path / "q", tmp_path / "oracle", "torch",
                                     {"tensor_parallel_size": 2, "num_threads": 1})
    model = LLM(str(tmp_path / "q"), dtype="float32", num_gpu_blocks_override=64, attention_backend="triton",
                enforce_eager=True, kv_cache_dtype="fp8").engine.runner.model
    attention = [layer.self_attn for layer in model.layers if hasattr(getattr(layer, "self_attn", None), "qkv_proj")]
    assert not isinstance(attention[0].qkv_proj, QuantLinear) and all(a.kv_scales.per_layer == (0.25, 0.125)
                                                                       for a in attention)
    if len(attention) > 1:
        assert attention[1].qkv_proj.weight.dtype == FP8 and not isinstance(model.layers[1].mlp.down_proj, QuantLinear)


def test_modelopt_formats_genq_cannot_serve_are_refused_by_name(tiny_llama_dir, tmp_path):
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="ModelOpt quant_algo 'NVFP4' is not supported; supported: FP8"):
        LLM(str(tmp_path / "m"), dtype="float32", num_gpu_blocks_override=16)


def asymmetric_grid(weight: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zero points (signed, as compressed-tensors holds them) [out, groups] spanning
    each group's range in 2^bits - 1 steps."""
    groups = weight.float().view(weight.shape[0], -1, group)
    low, high = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
    scale = (high - low) / (2**bits - 1)
    zero = (-low / scale).round() - 2 ** (bits - 1)
    return scale, zero.clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1).to(torch.int8)


def write_int_checkpoint(src: Path, out: Path, bits: int, strategy: str, fmt: str, symmetric: bool = True) -> Path:
    """`src` with its projections stored as compressed-tensors stores integer weights (its own
    compressor writes them, from scales and zero points computed here): int8 values
    (`int-quantized`), or values packed in int32 words (`pack-quantized`: W4A16, W8A16), a
    scale (and without `symmetric` a zero point) per output channel or per group of 32
    columns; the second layer's MLP left float."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    group = 32 if strategy == "group" else None
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    shutil.copytree(src, out)
    tensors = {}
    for name, value in load_file(src / "model.safetensors").items():
        if name.endswith("proj.weight") and ".layers.1.mlp." not in name and not symmetric:
            scale, zero = asymmetric_grid(value, bits, group or value.shape[1])
            stored = compressor.compress({"weight": value, "weight_scale": scale, "weight_zero_point": zero}, scheme)
            tensors.update({name.removesuffix("weight") + key: t for key, t in stored.items()})
        elif name.endswith("proj.weight") and ".layers.1.mlp." not in name:
            _, scale = quantize(value, (1, group or value.shape[1]), f"int{bits}")
            stored = compressor.compress({"weight": value, "weight_scale": scale}, scheme)
            tensors.update({name.removesuffix("weight") + key: t for key, t in stored.items()})
        else:
            tensors[name] = value
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "ignore": ["lm_head", "re:.*layers[.]1[.]mlp[.].*"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump()}}}
    (out / "config.json").write_text(json.dumps(config))
    return out


INT_CASES = {"W4A16 groups": (4, "group", "pack-quantized"), "W4A16 channels": (4, "channel", "pack-quantized"),
             "W8A16 packed": (8, "channel", "pack-quantized"), "W8A8 int8": (8, "channel", "int-quantized"),
             "W4A16 experts": (4, "group", "pack-quantized"), "W4A16 asymmetric": (4, "group", "pack-quantized"),
             "W8A16 asymmetric": (8, "channel", "pack-quantized")}


@pytest.mark.parametrize("case", list(INT_CASES))
def test_compressed_tensors_integer_checkpoints_match_transformers(request, tmp_path, case):
    """int4 and int8 weights against transformers with compressed-tensors dequantizing the
    same files; on the kernel path the projections and experts keep their integers (int4
    packed)."""
    from transformers import CompressedTensorsConfig

    bits, strategy, fmt = INT_CASES[case]
    src = request.getfixturevalue("tiny_qwen3_moe_dir" if "experts" in case else "tiny_llama_dir")
    int_dir = write_int_checkpoint(src, tmp_path / "int", bits, strategy, fmt, symmetric="asymmetric" not in case)
    stored = load_file(int_dir / "model.safetensors")
    assert stored["model.layers.0.self_attn.o_proj." + ("weight" if fmt == "int-quantized" else "weight_packed")].dtype == (
        torch.int8 if fmt == "int-quantized" else torch.int32)
    oracle = {"quantization_config": CompressedTensorsConfig(dequantize=True)}
    check_prefill_logits_against(int_dir, int_dir, "torch", **oracle)
    if case == "W8A8 int8":  # int4 words (and zero points) are read there by tests/worker/test_gptq_awq.py
        model = check_prefill_logits_against(int_dir, int_dir, "triton", **oracle).engine.runner.model
    else:
        model = LLM(str(int_dir), dtype="float32", num_gpu_blocks_override=64, attention_backend="triton",
                    enforce_eager=True).engine.runner.model
    storage = torch.int32 if bits == 4 else torch.int8
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.weight.dtype == storage
    assert (qkv.weight_zero is not None) == ("asymmetric" in case)
    assert not isinstance(model.layers[1].mlp.down_proj, QuantLinear)
    if "experts" in case:  # they keep their integers too, for the fused MoE kernel
        assert model.layers[0].mlp.experts.w13.dtype == model.layers[0].mlp.experts.w2.dtype == storage


def test_int4_packing_is_compressed_tensors_packing():
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    values = torch.randint(-8, 8, (5, 44), dtype=torch.int8)  # a row that ends mid-word
    assert torch.equal(pack_int4(values), pack_to_int32(values, 4))
    assert torch.equal(unpack(pack_int4(values), 4, 44), values)
    eights = torch.randint(-128, 128, (3, 12), dtype=torch.int8)
    assert torch.equal(unpack(pack_to_int32(eights, 8), 8), unpack_from_int32(pack_to_int32(eights, 8), 8, eights.shape))


def _rewrite_config(src: Path, out: Path, change) -> Path:
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    change(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("change, error", [
    (lambda c: c.update(quantization_config={"quant_method": "bitsandbytes"}), "quantized with 'bitsandbytes'"),
    (lambda c: c["quantization_config"].update(fmt="e5m2"), "fp8 format 'e5m2'"),
    (lambda c: c["quantization_config"].update(scale_fmt="ue8m0"), "scale format 'ue8m0'"),
    (lambda c: c["quantization_config"].update(weight_block_size=[128]), "weight_block_size must be two"),
])
def test_quantization_genq_cannot_serve_is_refused_by_name(tiny_llama_dir, tmp_path, change, error):
    bad = _rewrite_config(write_fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", BLOCK), tmp_path / "bad", change)
    with pytest.raises(ValueError, match=error):
        LLM(str(bad), dtype="float32", num_gpu_blocks_override=64)


def _weights(**change):
    return lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)


@pytest.mark.parametrize("change, error", [
    (_weights(type="int", num_bits=2), "weights of type 'int', 2 bits are not supported"),
    (_weights(num_bits=4), "weights of type 'float', 4 bits"),
    (_weights(symmetric=False), "8 bits, asymmetric are not supported"),
    (_weights(strategy="group", group_size=128), "weight strategy 'group' is not supported for fp8"),
    (_weights(type="int", num_bits=4, strategy="block"), "weight strategy 'block' is not supported for int4"),
    (_weights(type="int", num_bits=4, symmetric=False, strategy="tensor"),
     "strategy 'tensor' is not supported for asymmetric int4"),
    (_weights(type="int", num_bits=4, strategy="group", group_size=32, actorder="group"), "actorder 'group'"),
    (lambda c: c["quantization_config"].update(kv_cache_scheme={"num_bits": 8, "type": "int"}),
     "kv_cache_scheme .* is not supported"),
    (lambda c: c["quantization_config"].update(kv_cache_scheme={"num_bits": 8, "type": "float", "dynamic": True}),
     "kv_cache_scheme .* is not supported"),
    (lambda c: c["quantization_config"]["config_groups"].update(group_1={"targets": ["re:.*down_proj"]}),
     "checkpoints with 2 schemes"),
])
def test_compressed_tensors_schemes_genq_cannot_serve_are_refused_by_name(tiny_llama_dir, tmp_path, change, error):
    ct_dir = write_compressed_tensors_checkpoint(tiny_llama_dir, tmp_path / "ct", "channel")
    bad = _rewrite_config(ct_dir, tmp_path / "bad", change)
    with pytest.raises(ValueError, match=error):
        LLM(str(bad), dtype="float32", num_gpu_blocks_override=64)


def test_a_bad_quantization_argument_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization must be one of fp8, gptq, .* or None, got 'int4'"):
        LLM(str(tiny_llama_dir), quantization="int4")
    with pytest.raises(ValueError, match="quantization='awq' names the checkpoint's quantization, but the checkpoint "
                                         "has no quantization_config"):
        LLM(str(tiny_llama_dir), quantization="awq")


@pytest.mark.parametrize("src, block, drop, error", [
    # 48-row blocks do not divide q/k/v's or gate/up's shards: those layers are dequantized at
    # load, their weights waiting for their scales
    ("tiny_llama_dir", (48, 32), "model.layers.0.self_attn.k_proj.weight_scale_inv",
     "quantized weights without scales: model.layers.0.self_attn.k_proj.weight"),
    ("tiny_llama_dir", (48, 32), "model.layers.1.mlp.up_proj.weight", "scales of no quantized weight: model.layers.1.mlp.up_proj"),
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
    assert isinstance(layer.self_attn.o_proj, QuantLinear) and isinstance(layer.mlp.down_proj, QuantLinear)
    assert not isinstance(layer.self_attn.qkv_proj, QuantLinear) and not isinstance(layer.mlp.gate_up_proj, QuantLinear)
    check_prefill_logits_against(fp8_dir, dense_dir, "torch")
    check_prefill_logits_against(fp8_dir, dense_dir, "triton")


def test_a_float_weight_where_the_checkpoint_promises_fp8_is_refused(tiny_llama_dir, tmp_path):
    bad = write_fp8_checkpoint(tiny_llama_dir, tmp_path / "bad", BLOCK)
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = torch.randn(tensors[name].shape)
    del tensors[name + "_scale_inv"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.o_proj.weight' is torch.float32, but"):
        LLM(str(bad), dtype="float32", num_gpu_blocks_override=64)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lora_adapters_over_fp8_weights_match_peft(tiny_llama_dir, tiny_llama_adapters, tmp_path, backend):
    """Adapters add to the quantized projections' outputs: PEFT over transformers' dequantized
    model is the oracle."""
    from test_lora import PROMPTS as LORA_PROMPTS
    from test_lora import greedy, peft_greedy

    from worker import LoRARequest

    fp8_dir = write_fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", BLOCK)
    llm = LLM(str(fp8_dir), dtype="float32", num_gpu_blocks_override=64, enable_lora=True, max_num_seqs=4,
              attention_backend=backend)
    prompts = LORA_PROMPTS[:2]
    ids = [llm.get_tokenizer().encode(p) for p in prompts]
    expected = peft_greedy(fp8_dir, tiny_llama_adapters["all"], ids)
    assert expected != peft_greedy(fp8_dir, None, ids)
    adapter = LoRARequest("all", 1, str(tiny_llama_adapters["all"]))
    outs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=adapter)
    assert [o.outputs[0].token_ids for o in outs] == expected
