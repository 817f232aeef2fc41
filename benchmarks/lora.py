"""The cost of serving LoRA adapters: the same prompts on the default model, run by the base
model and with adapters, in one process.

    python benchmarks/lora.py [--prompts 64] [--max-tokens 64] [--rank 16] [--dtype bfloat16]

Adapters are random (rank `--rank` on all seven projections), written as PEFT directories
into a temporary folder. Runs, each on the same prompts with ignore_eos:

- base: an engine without LoRA;
- lora on, unused: an engine with enable_lora whose requests name no adapter;
- 1 adapter: every request with the same adapter;
- 4 adapters: requests spread over four adapters, max_loras=4, so each step mixes them;
- 4 adapters, 1 slot: the same over max_loras=1, so adapters take turns.

It prints generated tokens per second and each run's time per token against the base run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from worker import LLM, LoRARequest, SamplingParams
from worker.model_executor.model_loader import resolve_model_path

TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(out: Path, model_dir: Path, rank: int, seed: int) -> Path:
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    q = cfg["num_attention_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for block, names in TARGETS.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": [n for names in TARGETS.values() for n in names]}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def timed(llm: LLM, prompts: list[str], params: SamplingParams, loras) -> tuple[float, int]:
    llm.generate(prompts[:2], params, use_tqdm=False, lora_request=loras[:2] if isinstance(loras, list) else loras)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    model_dir = resolve_model_path(None)
    prompts = [f"Request {i}: tell me a short story about the number {i}." for i in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine_args = dict(dtype=args.dtype, max_model_len=1024, max_num_seqs=args.prompts)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", model_dir, args.rank, i)))
                    for i in range(4)]
        spread = [adapters[i % 4] for i in range(args.prompts)]
        rows.append(("base", *timed(LLM(None, **engine_args), prompts, params, None)))
        lora_llm = LLM(None, enable_lora=True, max_loras=4, max_lora_rank=args.rank, **engine_args)
        rows.append(("lora on, unused", *timed(lora_llm, prompts, params, None)))
        rows.append(("1 adapter", *timed(lora_llm, prompts, params, adapters[0])))
        rows.append(("4 adapters", *timed(lora_llm, prompts, params, spread)))
        one_slot = LLM(None, enable_lora=True, max_loras=1, max_lora_rank=args.rank, **engine_args)
        rows.append(("4 adapters, 1 slot", *timed(one_slot, prompts, params, spread)))
    print(f"{args.prompts} prompts x {args.max_tokens} tokens, rank {args.rank}, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'run':<20} {'s':>7} {'tokens/s':>9} {'x base time/token':>18}")
    base = rows[0][1] / rows[0][2]
    for name, seconds, tokens in rows:
        print(f"{name:<20} {seconds:7.2f} {tokens / seconds:9.1f} {seconds / tokens / base:18.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
