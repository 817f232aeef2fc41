"""`genq bench throughput` (offline: engine, queue, transformers) and `genq bench serve` (load on
a running API). Every figure is reported next to a baseline measured in the same run."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

from worker.benchmarks.floor import add_shares, compute_floor, format_floor
from worker.benchmarks.workload import RandomWorkload, Workload, load_dataset, summarize

MODES = ("engine", "queue", "hf")


def build(parser: argparse.ArgumentParser):
    # The queue mode starts its own Redis unless one is named (flag or GENQ_REDIS_URL).
    parser.set_defaults(redis_url=os.environ.get("GENQ_REDIS_URL"))
    sub = parser.add_subparsers(dest="bench", required=True)
    tp = sub.add_parser("throughput", help="offline throughput: engine, queue and transformers")
    _throughput_args(tp)
    sp = sub.add_parser("serve", help="latency and throughput under load on a running API")
    from worker.benchmarks.serve import add_serve_args

    add_serve_args(sp)
    return _run


def _run(args: argparse.Namespace) -> int:
    if args.bench == "serve":
        from worker.benchmarks.serve import run_serve

        return run_serve(args)
    return run_throughput(args)


def _throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: engine,queue,hf")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=None, help="mean input length (with --range-ratio)")
    p.add_argument("--output-len", type=int, default=None, help="mean output length (with --range-ratio)")
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", default=None, help="JSONL of prompts: {'prompt': str, 'max_tokens': int}")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="engine and queue modes: the KV pool's size in blocks (default: as memory allows)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: seeded random weights of the model's shape, no checkpoint needed "
                        "(every mode then runs those; for speed, not output)")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="engine and queue modes: the model's projections in fp8, quantized as they load")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="engine and queue modes: fp8 holds twice the tokens in the same KV memory")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton"],
                   help="engine and queue modes: cpu (genq's compiled CPU kernels), torch, triton, or auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="engine and queue modes: the model split over this many devices")
    p.add_argument("--max-step-ms", type=float, default=0,
                   help="engine and queue modes: step-time-aware chunking's target step time (default 0: off, "
                        "the static --max-num-batched-tokens, throughput's best)")
    p.add_argument("--no-floor", action="store_true", help="skip the compute floor (its FLOPs at a GEMM rate "
                   "measured in this run)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--redis-url", default=argparse.SUPPRESS,
                   help="queue mode: use this Redis instead of starting one (also $GENQ_REDIS_URL)")


def make_workload(args: argparse.Namespace) -> Workload:
    if args.dataset:
        return load_dataset(Path(args.dataset), args.num_prompts)
    if args.input_len is None and args.output_len is None:
        return RandomWorkload(num_prompts=args.num_prompts, seed=args.seed)  # W1
    return RandomWorkload.from_lengths(
        args.num_prompts, args.input_len or 144, args.output_len or 136, args.range_ratio, args.seed
    )


def run_throughput(args: argparse.Namespace) -> int:
    workload = make_workload(args)
    engine_args = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "num_gpu_blocks_override": args.num_gpu_blocks_override,
        "load_format": args.load_format,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "tensor_parallel_size": args.tensor_parallel_size,
        "max_step_ms": args.max_step_ms,  # (the queue's worker, a serving one, would default it on)
        "attention_backend": args.attention_backend,
    }
    results: dict[str, dict[str, Any]] = {}
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        results[mode] = _run_mode_isolated(mode, args, workload, engine_args)
        print(f"{mode}: {results[mode]}", flush=True)
    report: dict[str, Any] = {"workload": workload.describe(), "results": results}
    _add_ratios(results)
    if not args.no_floor:
        report["floor"] = floor = _run_mode_isolated("floor", args, workload, engine_args)
        add_shares(floor, results)
        print(format_floor(floor))
    print(format_table(results, report.get("floor")))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _run_mode_isolated(mode: str, args, workload: Workload, engine_args: dict) -> dict[str, Any]:
    """Each mode in a fresh process, so none runs on the heap, page and library state (oneDNN's
    primitive cache, say) another mode left behind. The processes fork from a server that has
    imported torch and transformers once and run nothing: a mode starts in a second, not the
    several an interpreter of its own takes to import them."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "worker.llm", "worker.benchmarks.throughput"])
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_run_mode_child, args=(sender, mode, args, workload, engine_args))
    child.start()
    sender.close()
    try:
        ok, result = receiver.recv()
    except EOFError:
        child.join()
        ok, result = False, f"the {mode} process exited with code {child.exitcode}"
    child.join()
    if not ok:
        raise SystemExit(f"bench mode {mode} failed: {result}")
    return result


def _run_mode_child(sender, mode: str, args, workload: Workload, engine_args: dict) -> None:
    try:
        sender.send((True, _run_mode(mode, args, workload, engine_args)))
    except BaseException as e:  # reported by the parent, which names the mode
        sender.send((False, f"{type(e).__name__}: {e}"))
        raise


def _run_mode(mode: str, args, workload: Workload, engine_args: dict) -> dict[str, Any]:
    if mode == "engine":
        return run_engine(args.model, args.dtype, workload, engine_args)
    if mode == "floor":
        return compute_floor(args.model, args.dtype, _lengths(args.model, workload))
    if mode == "hf":
        return run_hf(args.model, args.dtype, workload, args.hf_batch_size, load_format=args.load_format)
    from worker.benchmarks.queue import run_queue

    return run_queue(args, workload, engine_args)


def _lengths(model: str | None, workload: Workload) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per request."""
    tokenizer = None
    if not isinstance(workload, RandomWorkload):  # (random prompts are token ids already)
        from transformers import AutoTokenizer

        from worker.model_executor.model_loader import resolve_model_path

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
    return [(len(ids), n) for ids, n in workload.token_requests(tokenizer)]


def run_engine(model: str | None, dtype: str, workload: Workload, engine_args: dict) -> dict[str, Any]:
    from worker.llm import LLM

    llm = LLM(model=model, dtype=dtype, **engine_args)
    prompts, params = workload.prompts(), workload.sampling_params()
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    return summarize(elapsed, len(outputs), num_in, num_out)


def run_hf(
    model: str | None, dtype: str, workload: Workload, batch_size: int, device: str = "cpu",
    load_format: str = "auto",
) -> dict[str, Any]:
    """transformers' generate with static batches, left-padded, each batch running to its longest
    output; only the tokens each request asked for count. `load_format="dummy"`: transformers'
    own random initialisation of the model's config, seeded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from worker.model_executor.model_loader import resolve_model_path

    path = resolve_model_path(model)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    if load_format == "dummy":
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    hf = hf.to(device).eval()
    requests = workload.token_requests(AutoTokenizer.from_pretrained(path))
    _hf_batch(hf, requests[:2])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        _hf_batch(hf, requests[i : i + batch_size])
    if hf.device.type == "cuda":
        torch.cuda.synchronize(hf.device)  # the last batch's kernels count too
    elapsed = time.perf_counter() - start
    return summarize(elapsed, len(requests), sum(len(ids) for ids, _ in requests), sum(n for _, n in requests))


def _hf_batch(model, batch: list[tuple[list[int], int]], pad_id: int = 0) -> None:
    import torch

    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _ in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch], device=model.device)
    max_new = max(n for _, n in batch)
    with torch.inference_mode():
        model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new,
                       min_new_tokens=max_new, do_sample=False, pad_token_id=pad_id)


def _add_ratios(results: dict[str, dict[str, Any]]) -> None:
    for base, key in (("hf", "ratio_to_hf"), ("engine", "ratio_to_engine")):
        if base in results:
            for r in results.values():
                r[key] = round(r["output_tokens_per_s"] / results[base]["output_tokens_per_s"], 2)


def format_table(results: dict[str, dict[str, Any]], floor: dict[str, Any] | None = None) -> str:
    head = (f"{'mode':<8} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>12} {'vs hf':>7} {'vs engine':>10} "
            f"{'of floor':>9} {'of mem floor':>13}")
    lines = [head, "-" * len(head)]
    for mode, r in results.items():
        lines.append(
            f"{mode:<8} {r['requests_per_s']:>8.2f} {r['output_tokens_per_s']:>10.1f} "
            f"{r['total_tokens_per_s']:>12.1f} {_ratio(r, 'ratio_to_hf'):>7} {_ratio(r, 'ratio_to_engine'):>10} "
            f"{_share(r):>9} {_share(r, 'share_of_memory_floor'):>13}"
        )
    if floor is not None:  # what no mode can beat: the workload's FLOPs at the measured GEMM rate
        lines.append(f"{'floor':<8} {'':>8} {floor['output_tokens_per_s']:>10.1f} {'':>12} {'':>7} {'':>10} "
                     f"{'100.0%':>9} {'':>13}")
        lines.append(f"{'mem floor':<8} {'':>8} {floor['memory_floor_tokens_per_s']:>10.1f} {'':>12} {'':>7} "
                     f"{'':>10} {'':>9} {'100.0%':>13}")
    return "\n".join(lines)


def _ratio(r: dict[str, Any], key: str) -> str:
    return f"{r[key]:.2f}x" if key in r else "-"


def _share(r: dict[str, Any], key: str = "share_of_floor") -> str:
    return f"{100 * r[key]:.1f}%" if key in r else "-"
