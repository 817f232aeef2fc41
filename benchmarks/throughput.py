"""Offline throughput on a workload (W1 by default): the engine against transformers'
`generate` with static batches, same model, same dtype, measured in the same run.

    python benchmarks/throughput.py [--modes engine,hf] [--dtype bfloat16] [--num-prompts 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from workload import RandomWorkload  # noqa: E402

from producer.sampling_params import SamplingParams  # noqa: E402


def run_engine(model: str | None, dtype: str, requests, engine_args: dict) -> dict:
    from worker import LLM

    llm = LLM(model=model, dtype=dtype, **engine_args)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return _result(elapsed, len(requests), num_out, sum(len(ids) for ids, _ in requests))


def run_hf(model_path: Path, dtype: str, requests, batch_size: int) -> dict:
    """Static batches, left-padded; each batch runs to its longest output. Only the tokens each
    request asked for count as useful."""
    from transformers import AutoModelForCausalLM

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).eval()
    pad_id = 0
    _hf_batch(model, requests[:2], pad_id)  # warm-up
    start = time.perf_counter()
    num_out = 0
    for i in range(0, len(requests), batch_size):
        num_out += _hf_batch(model, requests[i : i + batch_size], pad_id)
    elapsed = time.perf_counter() - start
    return _result(elapsed, len(requests), num_out, sum(len(ids) for ids, _ in requests))


def _hf_batch(model, batch, pad_id: int) -> int:
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _ in batch])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
    max_new = max(n for _, n in batch)
    with torch.inference_mode():
        model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new,
                       min_new_tokens=max_new, do_sample=False, pad_token_id=pad_id)
    return sum(n for _, n in batch)


def _result(elapsed: float, num_requests: int, num_out: int, num_in: int) -> dict:
    return {
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(num_requests / elapsed, 3),
        "output_tokens_per_s": round(num_out / elapsed, 1),
        "total_tokens_per_s": round((num_out + num_in) / elapsed, 1),
        "output_tokens": num_out,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--modes", default="engine,hf")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from worker.model_loader import resolve_model_path

    workload = RandomWorkload(num_prompts=args.num_prompts)
    requests = workload.requests()
    results = {}
    for mode in args.modes.split(","):
        if mode == "engine":
            engine_args = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
            results[mode] = run_engine(args.model, args.dtype, requests, engine_args)
        elif mode == "hf":
            results[mode] = run_hf(resolve_model_path(args.model), args.dtype, requests, args.hf_batch_size)
        print(mode, results[mode], flush=True)
    if "hf" in results:
        for r in results.values():
            r["ratio_to_hf"] = round(r["output_tokens_per_s"] / results["hf"]["output_tokens_per_s"], 2)
    print(json.dumps({"workload": workload.describe(), "results": results}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": workload.describe(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
