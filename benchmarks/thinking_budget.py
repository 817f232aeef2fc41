"""What thinking budgets (`SamplingParams.thinking_token_budget`) cost the engine's steps: a batch
of chat prompts on the default model, greedy, every reply counted as thinking (the markers are
the chat template's generation prompt and `</think>`, as a template that opens the thinking
makes them), in one run:

  none      no budget (the baseline)
  tracked   a budget no reply reaches: each step follows every reply's tokens
  forced    a budget of 8: past it, each reply's rows are masked to the end marker's tokens

    python benchmarks/thinking_budget.py [--batch 32] [--max-tokens 64] [--dtype float32]

Prints tokens per second for each (the best of `--rounds` passes, the cases taking turns and
each going first in turn, so the machine's noise falls alike on each) and its ratio to none, after one warm-up pass.
"""

from __future__ import annotations

import argparse
import time

from worker import LLM, SamplingParams

MARKERS = {"think_start_str": "<|im_start|>assistant\n", "think_end_str": "</think>"}


def run(llm: LLM, prompts: list[list[dict[str, str]]], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.chat(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    llm = LLM(None, dtype=args.dtype, reasoning_config=MARKERS, max_num_seqs=args.batch)
    prompts = [[{"role": "user", "content": f"Think about the number {i}, then answer."}] for i in range(args.batch)]
    base = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    cases = {"none": base, "tracked": SamplingParams(**{**vars(base), "thinking_token_budget": 10 * args.max_tokens}),
             "forced": SamplingParams(**{**vars(base), "thinking_token_budget": 8})}
    run(llm, prompts[:4], base)  # warm-up
    best = dict.fromkeys(cases, 0.0)
    names = list(cases)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each case first in turn
            params = cases[name]
            seconds, tokens = run(llm, prompts, params)
            best[name] = max(best[name], tokens / seconds)
    print(f"batch {args.batch}, {args.max_tokens} tokens each, {args.dtype}, best of {args.rounds}")
    for name, rate in best.items():
        print(f"  {name:8s} {rate:8.1f} tok/s  {rate / best['none']:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
