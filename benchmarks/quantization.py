"""Quantized weights and an fp8 KV cache on the default model: what they save, what they cost.

    python benchmarks/quantization.py [--num-tokens 1024] [--num-prompts 64]

Variants, each against the bf16 model in the same run: fp8 weights (`quantization="fp8"`, a
scale per output channel), W4A16 weights (int4 in groups of 64 columns, symmetric, written
here as a compressed-tensors checkpoint from the default model's weights; 64, as the model's
576 columns are not a multiple of 128), AWQ weights (int4 in groups of 64 with a zero point
each, rounded to nearest as W4A16's are, written here in AutoAWQ's GEMM layout: the layout
and the asymmetric grid, without AWQ's activation-aware scaling), and an fp8 KV cache
(`kv_cache_dtype="fp8"`), without scales and with a scale per KV head calibrated here as
llm-compressor's kv_cache_scheme does (the largest |k| and |v| each head caches over a
calibration text, over 448; the text is not the one measured).

1. Memory: weight bytes as the kernel path holds them (quantized projections, bf16
   embeddings and norms), and KV cache blocks in the same memory.
2. Accuracy on real weights (SmolLM2-135M-Instruct): next-token distributions over a text,
   teacher-forced, against the bf16 model's: top-1 agreement and mean KL(bf16 || variant).
   Beside them, the bf16 model against float32: the rounding bf16 itself costs, the floor
   to read the others against. On the CPU path, whose dequantized weights are the kernels'
   up to summation order.
3. On a CUDA machine only: W1 throughput of each variant against bf16.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from worker import LLM
from worker.core.scheduler import ScheduledRequest, SchedulerOutput
from worker.model_executor.model_loader import resolve_model_path
from worker.model_executor.models.quant import pack_awq, quantize

TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels; stored programs made software a thing apart from hardware, and "
    "assemblers, compilers and operating systems each hid one more layer of detail. "
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "Les langues romanes descendent du latin vulgaire; el español, o português e l'italiano "
    "partagent une grande partie de leur vocabulaire. 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89. "
)
GROUP = 64


def write_w4a16(out: Path) -> Path:
    """The default model with its projections as int4 in groups of GROUP columns, packed, in
    compressed-tensors' layout."""
    source = resolve_model_path(None)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {}
    for file in source.glob("*.safetensors"):
        for name, value in load_file(file).items():
            if name.endswith("proj.weight"):
                packed, tensors[name.removesuffix("weight") + "weight_scale"] = quantize(value, (1, GROUP), "int4")
                name, value = name + "_packed", packed
            tensors[name] = value
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}}}
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_awq(out: Path) -> Path:
    """The default model with its projections as asymmetric int4 in groups of GROUP columns:
    each group's range over 15 steps from its zero point, in AutoAWQ's GEMM layout ([in,
    out / 8] words, outputs interleaved; scales [groups, out] float16)."""
    source = resolve_model_path(None)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {}
    for file in source.glob("*.safetensors"):
        for name, value in load_file(file).items():
            if not name.endswith("proj.weight"):
                tensors[name] = value
                continue
            groups = value.float().t().reshape(-1, GROUP, value.shape[0])  # [groups, GROUP, out]
            low, high = groups.amin(dim=1), groups.amax(dim=1)
            scale = ((high - low) / 15).clamp(min=1e-8).half()
            zero = (-low / scale.float()).round().clamp(0, 15)
            q = (groups / scale.float()[:, None] + zero[:, None]).round().clamp(0, 15).reshape(-1, value.shape[0])
            stem = name.removesuffix(".weight")
            tensors |= {f"{stem}.qweight": pack_awq(q), f"{stem}.qzeros": pack_awq(zero), f"{stem}.scales": scale}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                     "version": "gemm"}
    (out / "config.json").write_text(json.dumps(config))
    return out


CALIBRATION = (
    "Rivers shape the land they cross: they carve valleys, carry silt to the sea and feed the "
    "plains where the first cities grew. import numpy as np\nx = np.linspace(0, 1, 100)\n"
    "Der Rhein fließt durch sechs Länder; la Seine traverse Paris avant de rejoindre la Manche. "
    "Q: What is 17 * 23? A: 391. Q: Name a prime above 100. A: 101. "
) * 8


def write_kv_scaled(out: Path) -> Path:
    """The default model with fp8 KV-cache scales per KV head, calibrated on CALIBRATION."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.cache_utils import Cache

    source = resolve_model_path(None)
    shutil.copytree(source, out)
    maxima: dict[int, list[torch.Tensor]] = {}
    update = Cache.update

    def observe(self, k, v, layer_idx, *args, **kwargs):  # k, v: [1, kv_heads, T, D], as cached
        seen = [x.abs().amax(dim=(0, 2, 3)).float() for x in (k, v)]
        old = maxima.setdefault(layer_idx, seen)
        maxima[layer_idx] = [torch.maximum(a, b) for a, b in zip(old, seen, strict=True)]
        return update(self, k, v, layer_idx, *args, **kwargs)

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    ids = AutoTokenizer.from_pretrained(source).encode(CALIBRATION)
    Cache.update = observe
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]))
    finally:
        Cache.update = update
    save_file({f"model.layers.{i}.self_attn.{kind}_scale": (m / 448).reshape(-1, 1, 1).contiguous()
               for i, pair in maxima.items() for kind, m in zip("kv", pair, strict=True)},
              out / "kv_scales.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                     "kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "attn_head"}}
    (out / "config.json").write_text(json.dumps(config))
    return out


def memory(model: str | None, **kwargs) -> tuple[int, int]:
    """(weight bytes on the kernel path, KV blocks in 1 GiB)."""
    runner = LLM(model, attention_backend="triton", device="cpu", enforce_eager=True, max_model_len=256,
                 kv_cache_memory_gb=1.0, dtype="bfloat16", **kwargs).engine.runner
    return sum(p.numel() * p.element_size() for p in runner.model.parameters()), runner.num_blocks


def position_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32: the logits at every position, one prefill step."""
    runner = llm.engine.runner
    blocks = list(range(-(-len(ids) // runner.block_size)))
    out = runner.execute(SchedulerOutput([ScheduledRequest("r", ids, 0, blocks, True, prompt_logprobs=True)]))
    return out.chunk_logits["r"].float()


def compare(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference || other)) over positions."""
    agree = (reference.argmax(-1) == other.argmax(-1)).float().mean().item()
    kl = F.kl_div(other.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return agree, kl.mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-tokens", type=int, default=1024)
    ap.add_argument("--num-prompts", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        w4a16, awq = str(write_w4a16(Path(tmp) / "w4a16")), str(write_awq(Path(tmp) / "awq"))
        kv_scaled = str(write_kv_scaled(Path(tmp) / "kv_scaled"))
        variants = {"bf16": (None, {}), "fp8 weights": (None, {"quantization": "fp8"}),
                    "W4A16 weights": (w4a16, {}), "AWQ weights": (awq, {}),
                    "fp8 KV cache": (None, {"kv_cache_dtype": "fp8"}),
                    "fp8 KV, scaled": (kv_scaled, {"kv_cache_dtype": "fp8"})}
        base_bytes, base_blocks = memory(None)
        for name, (model, extra) in variants.items():
            weight_bytes, blocks = memory(model, **extra)
            print(f"{name:<14} weights {weight_bytes / 2**20:7.1f} MiB ({weight_bytes / base_bytes:.2f}x)   "
                  f"KV blocks in 1 GiB {blocks} ({blocks / base_blocks:.2f}x)")

        common = dict(max_model_len=2048, num_gpu_blocks_override=160, device="cpu")
        ids = LLM(None, **common).get_tokenizer().encode(TEXT * 20)[: args.num_tokens]
        reference = position_logits(LLM(None, dtype="bfloat16", **common), ids)
        floor = compare(position_logits(LLM(None, dtype="float32", **common), ids), reference)
        print(f"{'float32 vs bf16':<22} top-1 agreement {100 * floor[0]:6.2f}%   mean KL {floor[1]:.5f}")
        for name, (model, extra) in variants.items():
            if name != "bf16":
                agree, kl = compare(reference, position_logits(LLM(model, dtype="bfloat16", **common, **extra), ids))
                print(f"{name + ' vs bf16':<22} top-1 agreement {100 * agree:6.2f}%   mean KL {kl:.5f}   "
                      f"({len(ids)} positions)")

        if torch.cuda.is_available():
            from worker.benchmarks.throughput import run_engine
            from worker.benchmarks.workload import RandomWorkload

            workload = RandomWorkload(num_prompts=args.num_prompts)
            engine_args = {"device": "cuda", "max_model_len": 2048, "max_num_seqs": 256}
            tok = {name: run_engine(model, "bfloat16", workload, {**engine_args, **extra})["output_tokens_per_s"]
                   for name, (model, extra) in variants.items()}
            for name, value in tok.items():
                print(f"W1 cuda {name:<14} {value:8.1f} out tok/s   {value / tok['bf16']:.2f}x of bf16")


if __name__ == "__main__":
    main()
