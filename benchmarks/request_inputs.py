"""What a custom logits processor and a prompt given as embeddings cost, against the same
requests without them, on the default model, in one process.

    python benchmarks/request_inputs.py [--requests 16] [--max-tokens 64] [--dtype bfloat16]

"processor": greedy decoding with genq's NoRepeatNGram (a Python function per row and step,
scanning the request's tokens) at batch 1 and at `--requests`, against plain decoding.
"embeds": the same prompts as their input embeddings (`{"prompt_embeds": ...}`) against as
token ids: the embeddings' rows are copied in per prefill chunk. Prints output tokens per
second (the best of three runs) and the ratio for each.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from producer.sampling_params import SamplingParams
from worker import LLM


def timed(llm: LLM, prompts: list[Any], params: SamplingParams, repeats: int = 3) -> tuple[float, int]:
    """The best of `repeats` runs' seconds, and the tokens generated."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return best, sum(len(o.outputs[0].token_ids) for o in outs)


def row(name: str, seconds: float, tokens: int, base: float | None = None) -> None:
    ratio = f"{base / seconds:>8.2f}x" if base else ""
    print(f"{name:<44}{seconds:>9.2f}{tokens / seconds:>11.1f}{ratio}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, max_model_len=1024, enable_prefix_caching=False,
              logits_processors=["worker.sample.logits_processors:NoRepeatNGram"])
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    banned = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            extra_args={"no_repeat_ngram_size": 3})
    llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)  # warm-up
    print(f"{args.requests} requests of {args.prompt_len} tokens, {args.max_tokens} output tokens, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'run':<44}{'seconds':>9}{'tokens/s':>11}{'ratio':>9}")
    for batch in (1, args.requests):
        ids = [{"prompt_token_ids": p} for p in prompts[:batch]]
        base, tokens = timed(llm, ids, plain)
        row(f"batch {batch}: plain", base, tokens)
        seconds, tokens = timed(llm, ids, banned)
        row(f"batch {batch}: NoRepeatNGram(3)", seconds, tokens, base)
    model = llm.engine.runner.model
    with torch.inference_mode():
        embeds = [model.embed_tokens(torch.tensor(p)).float() for p in prompts]
    ids = [{"prompt_token_ids": p} for p in prompts]
    base, tokens = timed(llm, ids, plain)
    row(f"batch {args.requests}: token ids", base, tokens)
    seconds, tokens = timed(llm, [{"prompt_embeds": e} for e in embeds], plain)
    row(f"batch {args.requests}: prompt_embeds", seconds, tokens, base)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
