"""Embedding throughput: the engine's `LLM.embed` against transformers on the same prompts
and the same CPU, in one process.

    python benchmarks/embed.py [--prompts 256] [--min-len 16] [--max-len 256] [--dtype bfloat16]

Prompts are random token ids with lengths uniform in [min-len, max-len] (seed 0). The
baseline runs transformers' base model (`AutoModelForCausalLM(...).model`) on batches of
`--hf-batch` prompts of similar length (sorted), right-padded with an attention mask, and
takes each last real token's hidden state, normalized, as the engine pools. It prints prompt tokens per second of each and their ratio,
and the largest difference between the two sets of vectors (a check, not a target).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from worker import LLM, PoolingParams
from worker.model_executor.model_loader import resolve_model_path

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def prompts_of(n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_embed(model, prompts: list[list[int]], batch: int) -> list[torch.Tensor]:
    """Batches of similar lengths (sorted), right-padded; the last real token of each."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[torch.Tensor | None] = [None] * len(prompts)
    with torch.inference_mode():
        for start in range(0, len(order), batch):
            ids = [prompts[i] for i in order[start : start + batch]]
            width = max(map(len, ids))
            tokens = torch.tensor([p + [0] * (width - len(p)) for p in ids])
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in ids])
            hidden = model(input_ids=tokens, attention_mask=mask).last_hidden_state
            for row, i in enumerate(order[start : start + batch]):
                out[i] = torch.nn.functional.normalize(hidden[row, len(prompts[i]) - 1].float(), dim=-1)
    return [v for v in out if v is not None]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--hf-batch", type=int, default=16)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_path(None)
    llm = LLM(str(model_dir), dtype=args.dtype, max_model_len=1024, max_num_seqs=256)
    prompts = prompts_of(args.prompts, args.min_len, args.max_len, llm.engine.model_config.vocab_size)
    num_tokens = sum(map(len, prompts))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[args.dtype]).model.eval()

    llm.embed([{"prompt_token_ids": p} for p in prompts[:4]], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(), use_tqdm=False)
    engine_s = time.perf_counter() - start
    hf_embed(hf, prompts[:4], args.hf_batch)  # warm-up
    start = time.perf_counter()
    expected = hf_embed(hf, prompts, args.hf_batch)
    hf_s = time.perf_counter() - start

    diff = max((torch.tensor(o.outputs.embedding) - e).abs().max().item() for o, e in zip(outs, expected, strict=True))
    print(f"{args.prompts} prompts, {num_tokens} tokens, lengths [{args.min_len}, {args.max_len}], {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'run':<28}{'seconds':>9}{'tokens/s':>11}")
    print(f"{'transformers (batch ' + str(args.hf_batch) + ')':<28}{hf_s:>9.2f}{num_tokens / hf_s:>11.0f}")
    print(f"{'genq LLM.embed':<28}{engine_s:>9.2f}{num_tokens / engine_s:>11.0f}")
    print(f"ratio (genq / transformers): {hf_s / engine_s:.2f}x; largest vector difference {diff:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
