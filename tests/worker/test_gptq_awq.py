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
import zlib
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine import check_prefill_logits_against

from worker import LLM
from worker.model_executor.models.quant import QuantLinear, pack_awq

GROUP = 32
KEEP_FLOAT = "model.layers.1.mlp"  # left float, listed in modules_to_not_convert


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


SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def input_order(name: str, columns: int) -> torch.Tensor:
    """GPTQ act-order's column order for a projection: one per input, shared by the layers
    that read it (q/k/v; gate/up), as GPTQ's order follows the input's statistics."""
    *layer, proj, _ = name.split(".")
    key = ".".join([*layer, SHARED_INPUT.get(proj, proj)])
    return torch.randperm(columns, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))


def write_checkpoint(src: Path, out: Path, oracle: Path, method: str, bits: int = 4, sym: bool = False,
                     group: int = GROUP, v2: bool = False, act_order: bool = False) -> None:
    """`src` with its decoder projections (experts' too) stored as `method` ("awq" or
    "gptq") stores them, in `out`; in `oracle`, the float checkpoint of the weights AutoAWQ's
    dequantizer reads from them (8-bit GPTQ, which AWQ has no layout for, and act-order
    GPTQ, whose groups AWQ has no g_idx for: (q - zero) * scale computed here, each
    column's group from g_idx)."""
    packing = autoawq_packing()
    shutil.copytree(src, out)
    shutil.copytree(src, oracle)
    stored, dense = {}, {}
    for name, weight in load_file(src / "model.safetensors").items():
        if not name.endswith("proj.weight") or name.startswith(KEEP_FLOAT + "."):
            stored[name] = dense[name] = weight
            continue
        cols = weight.shape[1] if group == -1 else group
        stem = name.removesuffix(".weight")
        if act_order:  # the columns quantized in a shuffled order, groups of consecutive ones in it
            order = input_order(name, weight.shape[1])
            shuffled, zero, scale = quantize_groups(weight[:, order], bits, cols, sym)
            q = torch.empty_like(shuffled)
            q[order] = shuffled  # stored in the columns' own order
            g_idx = torch.empty(weight.shape[1], dtype=torch.int32)
            g_idx[order] = (torch.arange(weight.shape[1]) // cols).to(torch.int32)
            qweight, qzeros = packing.pack_exllama(q, zero - 1, bits)
            stored |= {f"{stem}.qweight": qweight, f"{stem}.qzeros": qzeros, f"{stem}.scales": scale,
                       f"{stem}.g_idx": g_idx}
            dense[name] = ((q - zero[g_idx.long()]) * scale.float()[g_idx.long()]).t().contiguous()
            continue
        q, zero, scale = quantize_groups(weight, bits, cols, sym)
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
                                         "desc_act": act_order, "checkpoint_format": "gptq_v2" if v2 else "gptq",
                                         "modules_to_not_convert": [KEEP_FLOAT]}
    (out / "config.json").write_text(json.dumps(config))


# name: (model fixture, method, bits, sym, group, GPTQ v2, act-order, also the kernel path)
CASES = {
    "AWQ": ("tiny_llama_dir", "awq", 4, False, GROUP, False, False, True),
    "GPTQ asymmetric": ("tiny_llama_dir", "gptq", 4, False, GROUP, False, False, False),
    "GPTQ symmetric per channel": ("tiny_llama_dir", "gptq", 4, True, -1, False, False, False),
    "GPTQ 8-bit v2": ("tiny_llama_dir", "gptq", 8, False, GROUP, True, False, False),
    "GPTQ act-order": ("tiny_llama_dir", "gptq", 4, True, GROUP, False, True, True),
    "GPTQ experts": ("tiny_qwen3_moe_dir", "gptq", 4, False, GROUP, False, False, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gptq_and_awq_checkpoints_match_transformers(request, tmp_path, case):
    fixture, method, bits, sym, group, v2, act_order, kernels = CASES[case]
    src = request.getfixturevalue(fixture)
    write_checkpoint(src, tmp_path / "q", tmp_path / "oracle", method, bits, sym, group, v2, act_order)
    check_prefill_logits_against(tmp_path / "q", tmp_path / "oracle", "torch")
    if not kernels:
        return
    model = check_prefill_logits_against(tmp_path / "q", tmp_path / "oracle", "triton").engine.runner.model
    # on the kernel path the integers stay as narrow as the checkpoint's, with their zero points
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.weight.dtype == (torch.int32 if bits == 4 else torch.int8)
    assert (qkv.weight_zero is None) == sym and (qkv.input_perm is None) != act_order
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
    (_quant(lm_head=True), "quantized lm_head"),
    (_quant(checkpoint_format="marlin"), "GPTQ checkpoint_format 'marlin'"),
    (_quant(quant_method="awq", version="gemv"), "AWQ checkpoints of 4 bits, version 'gemv'"),
    (_quant(quant_method="awq", zero_point=False), "without zero points are not supported"),
])
def test_gptq_and_awq_schemes_genq_cannot_serve_are_refused_by_name(gptq_dir, tmp_path, change, error):
    with pytest.raises(ValueError, match=error):
        LLM(str(_changed(gptq_dir, tmp_path / "bad", config=change)), dtype="float32", num_gpu_blocks_override=16)


def test_quantization_argument_names_the_checkpoints_method(gptq_dir):
    """vLLM's `quantization` names (its Marlin aliases too) confirm the checkpoint's method; another
    method is refused by name."""
    llm = LLM(str(gptq_dir), dtype="float32", num_gpu_blocks_override=64, quantization="gptq_marlin")
    assert llm.engine.runner.model_config.quant.packing == "gptq"
    for other in ("awq", "fp8"):
        with pytest.raises(ValueError, match=f"quantization='{other}' does not match the checkpoint's quant_method 'gptq'"):
            LLM(str(gptq_dir), dtype="float32", num_gpu_blocks_override=16, quantization=other)


def test_act_order_experts_are_refused_by_name(tiny_qwen3_moe_dir, tmp_path):
    config = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True, "desc_act": True}
    moe = _changed(tiny_qwen3_moe_dir, tmp_path / "moe", config=lambda c: c | {"quantization_config": config})
    with pytest.raises(ValueError, match=r"GPTQ experts quantized with desc_act \(act-order\) are not supported"):
        LLM(str(moe), dtype="float32", num_gpu_blocks_override=16)


def test_gptq_tensors_that_break_the_config_are_refused_by_name(gptq_dir, tmp_path):
    o_proj = "model.layers.0.self_attn.o_proj"

    def shuffle_groups(weights):
        weights[f"{o_proj}.g_idx"] = weights[f"{o_proj}.g_idx"].flip(0)

    unordered = _changed(gptq_dir, tmp_path / "act_order", tensors=shuffle_groups)
    with pytest.raises(ValueError, match=rf"'{o_proj}.g_idx' puts the columns in groups out of order .* says desc_act false"):
        LLM(str(unordered), dtype="float32", num_gpu_blocks_override=16)
    # act-order: every group its size; the shards of a fused layer in one order

    def swap(proj, first, second):
        def change(weights):
            weights[f"model.layers.0.{proj}.g_idx"][[first, second]] = weights[f"model.layers.0.{proj}.g_idx"][[second, first]]
        return change

    def uneven(weights):
        weights["model.layers.0.mlp.up_proj.g_idx"][0] = 1

    act_order = _changed(gptq_dir, tmp_path / "desc_act", config=_quant(desc_act=True))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.g_idx' does not put 32 columns in each group"):
        LLM(str(_changed(act_order, tmp_path / "uneven", tensors=uneven)), dtype="float32", num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match=r"self_attn.[qkv]_proj.input_perm': the shards of one fused layer order their columns differently"):
        LLM(str(_changed(act_order, tmp_path / "k", tensors=swap("self_attn.k_proj", 0, 40))), dtype="float32",
            num_gpu_blocks_override=16)
    # asymmetric zero points where the config says sym
    with pytest.raises(ValueError, match=r"'.*qzeros' holds zero points other than 8, but .* says sym"):
        LLM(str(_changed(gptq_dir, tmp_path / "sym", config=_quant(sym=True))), dtype="float32", num_gpu_blocks_override=16)
