"""GPTQ and AWQ checkpoints against transformers over the same weights dequantized.

No GPTQ or AWQ kernel package runs on this CPU, so the oracle is built from AutoAWQ's own
code: its dequantizer (`dequantize_gemm`) reads the AWQ tensors written here, and what it
reads is the float checkpoint transformers serves; AutoAWQ's converter to the exllama
(GPTQ) layout (`unpack_reorder_pack`, `pack_exllama`) writes the GPTQ tensors from those
same integers. genq reads the quantized files."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine import check_prefill_logits_against

from worker import LLM
from worker.models.quant import QuantLinear

GROUP = 32
KEEP_FLOAT = "model.layers.1.mlp"  # left float, listed in modules_to_not_convert
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ packs output 8w + AWQ_ORDER[i] into nibble i of word w


def autoawq_packing() -> ModuleType:
    """AutoAWQ's awq/utils/packing_utils.py (plain torch), loaded by path: importing the awq
    package would import its model zoo, written for older transformers."""
    package = importlib.util.find_spec("awq")
    assert package is not None and package.origin is not None, "autoawq is installed by `make test`"
    spec = importlib.util.spec_from_file_location("awq_packing_utils", Path(package.origin).parent / "utils" / "packing_utils.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quantize_groups(weight: torch.Tensor, bits: int, group: int, sym: bool):
    """A float weight [out, in] as unsigned integers per group of `group` input columns:
    (int [in, out], zero points [groups, out], scales [groups, out] float16), transposed as
    GPTQ and AWQ store them. Asymmetric: each group's range over 2^bits - 1 steps; symmetric:
    its largest magnitude over 2^(bits-1) - 1, zero points 2^(bits-1)."""
    top, mid = 2**bits - 1, 2 ** (bits - 1)
    groups = weight.float().t().reshape(-1, group, weight.shape[0])  # [groups, group, out]
    if sym:
        scale = groups.abs().amax(dim=1) / (mid - 1)
        zero = torch.full_like(scale, mid)
    else:
        low, high = groups.amin(dim=1), groups.amax(dim=1)
        scale = (high - low) / top
        zero = (-low / scale).round().clamp(1, top)  # GPTQ's first format stores zero - 1: keep it >= 0
    scale = scale.half()
    q = (groups / scale.float()[:, None] + zero[:, None]).round().clamp(0, top)
    return q.reshape(-1, weight.shape[0]).long(), zero.long(), scale


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """4-bit values [rows, out] packed as AutoAWQ's GEMM layout packs them: [rows, out / 8] int32."""
    words = values.view(values.shape[0], -1, 8)[:, :, list(AWQ_ORDER)] << torch.arange(0, 32, 4)
    words = words.sum(-1)
    return (words - (words >= 2**31) * 2**32).to(torch.int32)  # the same 32 bits


def write_checkpoint(src: Path, out: Path, oracle: Path, method: str, bits: int = 4, sym: bool = False,
                     group: int = GROUP, v2: bool = False) -> None:
    """`src` with its decoder projections (experts' too) stored as `method` ("awq" or
    "gptq") stores them, in `out`; in `oracle`, the float checkpoint of the weights AutoAWQ's
    dequantizer reads from them (8-bit GPTQ, which AWQ has no layout for: (q - zero) *
    scale computed here)."""
    packing = autoawq_packing()
    shutil.copytree(src, out)
    shutil.copytree(src, oracle)
    stored, dense = {}, {}
    for name, weight in load_file(src / "model.safetensors").items():
        if not name.endswith("proj.weight") or name.startswith(KEEP_FLOAT + "."):
            stored[name] = dense[name] = weight
            continue
        cols = weight.shape[1] if group == -1 else group
        q, zero, scale = quantize_groups(weight, bits, cols, sym)
        stem = name.removesuffix(".weight")
        if bits == 4:
            qweight, qzeros = pack_awq(q), pack_awq(zero)
            dequantized = packing.dequantize_gemm(qweight, qzeros, scale.float(), 4, cols)  # [in, out]
            assert torch.equal(dequantized, (q - zero.repeat_interleave(cols, 0)) * scale.float().repeat_interleave(cols, 0))
            if method == "gptq" and not v2:  # AutoAWQ's converter: values along the inputs, zero points less one
                qweight, qzeros = packing.unpack_reorder_pack(qweight, qzeros, 4)
        else:
            dequantized = (q - zero.repeat_interleave(cols, 0)) * scale.float().repeat_interleave(cols, 0)
        if method == "gptq" and (bits == 8 or v2):
            qweight, qzeros = packing.pack_exllama(q, zero - (0 if v2 else 1), bits)
        stored |= {f"{stem}.qweight": qweight, f"{stem}.qzeros": qzeros, f"{stem}.scales": scale}
        if method == "gptq":
            stored[f"{stem}.g_idx"] = (torch.arange(q.shape[0]) // cols).to(torch.int32)
        dense[name] = dequantized.t().contiguous()
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    save_file(dense, oracle / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    if method == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True,
                                         "version": "gemm", "modules_to_not_convert": [KEEP_FLOAT]}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
                                         "desc_act": False, "checkpoint_format": "gptq_v2" if v2 else "gptq",
                                         "modules_to_not_convert": [KEEP_FLOAT]}
    (out / "config.json").write_text(json.dumps(config))


# name: (model fixture, method, bits, sym, group, GPTQ v2, also the kernel path)
CASES = {
    "AWQ": ("tiny_llama_dir", "awq", 4, False, GROUP, False, True),
    "GPTQ asymmetric": ("tiny_llama_dir", "gptq", 4, False, GROUP, False, False),
    "GPTQ symmetric per channel": ("tiny_llama_dir", "gptq", 4, True, -1, False, False),
    "GPTQ 8-bit v2": ("tiny_llama_dir", "gptq", 8, False, GROUP, True, False),
    "GPTQ experts": ("tiny_qwen3_moe_dir", "gptq", 4, False, GROUP, False, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gptq_and_awq_checkpoints_match_transformers(request, tmp_path, case):
    fixture, method, bits, sym, group, v2, kernels = CASES[case]
    src = request.getfixturevalue(fixture)
    write_checkpoint(src, tmp_path / "q", tmp_path / "oracle", method, bits, sym, group, v2)
    check_prefill_logits_against(tmp_path / "q", tmp_path / "oracle", "torch")
    if not kernels:
        return
    model = check_prefill_logits_against(tmp_path / "q", tmp_path / "oracle", "triton").engine.runner.model
    # on the kernel path the integers stay as narrow as the checkpoint's, with their zero points
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.weight.dtype == (torch.int32 if bits == 4 else torch.int8)
    assert qkv.weight_zero.dtype == torch.int8
    assert not isinstance(model.layers[1].mlp.down_proj, QuantLinear)
    if "experts" in case:
        assert model.layers[0].mlp.experts.w13.dtype == torch.int32 and model.layers[0].mlp.experts.w2_zero.dtype == torch.int8


@pytest.fixture(scope="module")
def gptq_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gptq")
    write_checkpoint(tiny_llama_dir, root / "q", root / "oracle", "gptq")
    return root / "q"


def _changed(src: Path, out: Path, config=None, tensors=None) -> Path:
    shutil.copytree(src, out)
    if config:
        path = out / "config.json"
        path.write_text(json.dumps(config(json.loads(path.read_text()))))
    if tensors:
        weights = load_file(out / "model.safetensors")
        tensors(weights)
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _quant(**fields):
    return lambda config: config | {"quantization_config": config["quantization_config"] | fields}


@pytest.mark.parametrize("change, error", [
    (_quant(bits=3), "GPTQ checkpoints of 3 bits are not supported"),
    (_quant(desc_act=True), "quantized with desc_act .act-order"),
    (_quant(lm_head=True), "quantized lm_head"),
    (_quant(checkpoint_format="marlin"), "GPTQ checkpoint_format 'marlin'"),
    (_quant(quant_method="awq", version="gemv"), "AWQ checkpoints of 4 bits, version 'gemv'"),
    (_quant(quant_method="awq", zero_point=False), "without zero points are not supported"),
])
def test_gptq_and_awq_schemes_genq_cannot_serve_are_refused_by_name(gptq_dir, tmp_path, change, error):
    with pytest.raises(ValueError, match=error):
        LLM(str(_changed(gptq_dir, tmp_path / "bad", config=change)), dtype="float32", num_gpu_blocks_override=16)


def test_gptq_tensors_that_break_the_config_are_refused_by_name(gptq_dir, tmp_path):
    o_proj = "model.layers.0.self_attn.o_proj"

    def shuffle_groups(weights):
        weights[f"{o_proj}.g_idx"] = weights[f"{o_proj}.g_idx"].flip(0)

    unordered = _changed(gptq_dir, tmp_path / "act_order", tensors=shuffle_groups)
    with pytest.raises(ValueError, match=rf"'{o_proj}.g_idx' puts the columns in groups out of order"):
        LLM(str(unordered), dtype="float32", num_gpu_blocks_override=16)
    # asymmetric zero points where the config says sym
    with pytest.raises(ValueError, match=r"'.*qzeros' holds zero points other than 8, but .* says sym"):
        LLM(str(_changed(gptq_dir, tmp_path / "sym", config=_quant(sym=True))), dtype="float32", num_gpu_blocks_override=16)
