"""What OpenAI's predicted outputs (`SamplingParams.prediction`, chat's `prediction`) buy on a
worker that guesses with n-grams: prompts answered one at a time (batch 1, where latency is
what guessing saves) on the default model, greedy, in one run:

  plain         no speculative decoding (the baseline)
  ngram         speculative_config {"method": "ngram"}, no prediction
  ngram + same  the prediction is the answer itself (a regenerated reply, an unchanged file)
  ngram + edit  the prediction with every eighth word changed (an edited file)

    python benchmarks/predicted_outputs.py [--max-tokens 128] [--dtype float32] [--guesses 4]

Prints tokens per second for each, its ratio to plain, the guesses kept per step, and how
many answers came out token for token as plain decoding's (all of them in float32, where
guessing is lossless; in bfloat16 a step that checks several tokens rounds otherwise than
one that computes one, and a greedy answer may part ways).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from worker import LLM, SamplingParams

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain in a short paragraph why the sky is blue.",
    "Write a haiku about a queue of jobs, then explain it.",
    "List five tips for writing clear commit messages.",
]


def edited(text: str) -> str:
    words = text.split(" ")
    return " ".join("changed" if i % 8 == 7 else w for i, w in enumerate(words))


def run(llm: LLM, params: list[SamplingParams]) -> tuple[float, list[list[int]], float]:
    """Seconds, the tokens, and guesses kept per guessing step, prompt by prompt."""
    stats = llm.engine.speculator.stats
    before = (stats.num_accepted_tokens, stats.num_drafts) if stats else (0, 0)
    start, tokens = time.perf_counter(), []
    for prompt, p in zip(PROMPTS, params, strict=True):
        [out] = llm.chat([{"role": "user", "content": prompt}], p, use_tqdm=False)
        tokens.append(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    if not stats:
        return seconds, tokens, 0.0
    kept, steps = stats.num_accepted_tokens - before[0], stats.num_drafts - before[1]
    return seconds, tokens, kept / max(steps, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--guesses", type=int, default=4)
    args = ap.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    plain = LLM(None, dtype=args.dtype, max_model_len=1024)
    run(plain, [params] * len(PROMPTS))  # warm-up
    base_s, answers, _ = run(plain, [params] * len(PROMPTS))
    del plain
    spec = LLM(None, dtype=args.dtype, max_model_len=1024,
               speculative_config={"method": "ngram", "num_speculative_tokens": args.guesses, "prompt_lookup_max": 4})
    tokenizer = spec.get_tokenizer()
    texts = [tokenizer.decode(a) for a in answers]
    run(spec, [params] * len(PROMPTS))  # warm-up
    rows = [("plain", base_s, 0.0, len(PROMPTS))]
    for name, predictions in (("ngram", [None] * len(PROMPTS)), ("ngram + same", texts),
                              ("ngram + edit", [edited(t) for t in texts])):
        seconds, tokens, kept = run(spec, [dataclasses.replace(params, prediction=p) for p in predictions])
        rows.append((name, seconds, kept, sum(t == a for t, a in zip(tokens, answers, strict=True))))
    total = sum(len(a) for a in answers)
    print(f"{'run':<14} {'s':>6} {'tok/s':>7} {'vs plain':>9} {'kept/step':>10} {'same':>5}")
    for name, seconds, kept, same in rows:
        print(f"{name:<14} {seconds:6.2f} {total / seconds:7.1f} {base_s / seconds:8.2f}x {kept:10.2f} "
              f"{same:>2}/{len(PROMPTS)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
