"""Speculative decoding with n-gram guesses against plain decoding, on the default model, in
one process.

    python benchmarks/spec_decode.py [--max-tokens 128] [--k 4] [--dtype bfloat16] [--disable-by-batch-size N]
    python benchmarks/spec_decode.py --arch qwen3_5   # a model with states, its guesses' rewinds
    python benchmarks/spec_decode.py --arch deepseek_v3 --method mtp --k 1   # its MTP layer's guesses
    python benchmarks/spec_decode.py --arch qwen3 --method eagle3 --k 3   # an EAGLE-3 head's

`--arch` remakes the default model's shape as a model with per-request states (Qwen3.5's
linear attention, `granitemoehybrid`'s or `nemotron_h`'s Mamba2) with seeded random
weights, which take back wrong guesses otherwise than by KV positions (the state after the
step's known tokens comes back, and the guesses kept are computed again by the next step).
What random weights write is noise no guess foresees, so its workload ("held") holds the
copy prompts' replies to the few tokens of " width height w h" (allowed_token_ids): they
repeat themselves, and guesses are kept in part.

`--method mtp` guesses with the remade model's multi-token-prediction layer (DeepSeek-V3's
shape, or GLM-4.5's); `--method eagle3` with an EAGLE-3 head of the remade model's width.
Their random weights foresee nothing, so two workloads bound what they do: "wrong" (the layer's guesses as they come: all but never kept, so what guessing costs)
and "right" (the target's and the layer's final norms zeroed after loading, so both always
pick token 0: every guess kept, what it gains at best).

Workloads (greedy): "copy" asks the model to repeat and edit text it was given (where
prompt lookup helps: code edits, quoting, extraction); "free" asks for new text (where
guesses are rarely right and only cost); "guided" asks for lines of a fixed form (a regex:
structured output, whose keys repeat). Each at batch 1 (latency) and 16 (throughput).
Prints output tokens per second for each, the speed-up, the share of guesses kept, and the
engine steps (forward passes) against plain decoding's: on a GPU, where a decode step's few
rows cost about what one row does, those are what guessing saves; on the CPU every row
costs. Outputs are checked identical to plain decoding.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

from gpu_check import remake, write_eagle3_head

from worker import LLM, SamplingParams

CODE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
        "    return 2 * (width + height)\n\n\ndef diagonal(width, height):\n"
        "    return (width ** 2 + height ** 2) ** 0.5\n")
COPY = [
    [{"role": "user", "content": f"Rename `width` to `w` and `height` to `h` in this code ({i}):\n\n{CODE}"}]
    for i in range(16)
]
FREE = [[{"role": "user", "content": f"Write a short story about a lighthouse keeper, part {i}."}] for i in range(16)]
PEOPLE = [[{"role": "user", "content": f"Name six people and the city each lives in ({i})."}] for i in range(16)]
LINES = r"(- name: [A-Z][a-z]{1,10}, city: [A-Z][a-z]{1,10}\n){6}"


def timed(llm: LLM, messages: list, params: SamplingParams) -> tuple[float, list[list[int]], int]:
    """Seconds, the replies, and the engine steps (forward passes) they took."""
    llm.chat(messages[:1], params, use_tqdm=False)  # warm-up
    engine, steps = llm.engine, 0
    step = engine.step

    def counted() -> Any:
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        outs = llm.chat(messages, params, use_tqdm=False)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs], steps
    finally:
        del engine.step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--disable-by-batch-size", type=int, default=None, help="no guesses at this many requests")
    ap.add_argument("--arch", default=None, choices=["qwen3_5", "granitemoehybrid", "nemotron_h", "deepseek_v3",
                                                     "glm4_moe", "qwen3"],
                    help="the default model's shape remade so, with random weights")
    ap.add_argument("--method", default="ngram", choices=["ngram", "mtp", "eagle3"])
    args = ap.parse_args()
    if args.method == "mtp" and args.arch not in ("deepseek_v3", "glm4_moe"):
        ap.error("--method mtp needs --arch deepseek_v3 or glm4_moe (a shape with an MTP layer)")
    if args.method == "eagle3" and args.arch is None:
        ap.error("--method eagle3 needs --arch (the remade model its head is written for)")
    with tempfile.TemporaryDirectory() as tmp:
        model = remake(None, args.arch, tmp) if args.arch else None
        return compare(model, args)


def compare(model: str | None, args: argparse.Namespace) -> int:
    extra = {"load_format": "dummy"} if model else {}
    plain = LLM(model, dtype=args.dtype, max_model_len=2048, **extra)
    guessing: dict[str, Any] = {"method": "ngram", "prompt_lookup_max": 4}
    if args.method == "mtp":
        guessing = {"method": "mtp"}
    elif args.method == "eagle3":
        assert model is not None  # (the remade one)
        guessing = {"method": "eagle3", "model": write_eagle3_head(model)}
    spec = LLM(model, dtype=args.dtype, max_model_len=2048, **extra,
               speculative_config={**guessing, "num_speculative_tokens": args.k,
                                   "disable_by_batch_size": args.disable_by_batch_size})
    print(f"{args.arch or 'default model'}, greedy, max_tokens {args.max_tokens}, k={args.k}, {args.dtype}, "
          f"disable_by_batch_size {args.disable_by_batch_size}")
    print(f"{'workload':<10} {'batch':>5} {'plain tok/s':>12} {args.method + ' tok/s':>12} {'speed-up':>9} "
          f"{'kept':>6} {'steps':>6} {'same':>5}")
    workloads: tuple[tuple[str, list, dict], ...] = (("copy", COPY, {}), ("free", FREE, {}),
                                                     ("guided", PEOPLE, {"guided_decoding": {"regex": LINES}}))
    if args.method in ("mtp", "eagle3"):
        workloads = (("wrong", FREE, {"ignore_eos": True}), ("right", FREE, {"ignore_eos": True}))
    elif model is not None:  # (random weights write to the end: no EOS)
        held = sorted(set(plain.get_tokenizer().encode(CODE)))[:12]
        workloads = (("held", COPY, {"allowed_token_ids": held, "ignore_eos": True}),)
    for name, messages, held_to in workloads:
        if name == "right":  # the final norms zeroed: the target and the MTP layer pick token 0 alike
            for runner in (plain.engine.runner, spec.engine.runner, spec.engine.speculator.proposer.runner):
                runner.model.norm.weight.data.zero_()
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, **held_to)
        for batch in (1, 16):
            plain_s, plain_out, plain_steps = timed(plain, messages[:batch], params)
            stats = spec.engine.speculator.stats
            drafted, kept = stats.num_draft_tokens, stats.num_accepted_tokens
            spec_s, spec_out, spec_steps = timed(spec, messages[:batch], params)
            tokens = sum(len(t) for t in plain_out)
            rate = (stats.num_accepted_tokens - kept) / max(stats.num_draft_tokens - drafted, 1)
            print(f"{name:<10} {batch:>5} {tokens / plain_s:12.1f} {tokens / spec_s:12.1f} "
                  f"{plain_s / spec_s:8.2f}x {rate:6.0%} {spec_steps / plain_steps:5.2f}x {str(plain_out == spec_out):>5}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
