"""FP8 weights (`quantization="fp8"`) on the default model: what they save and what they cost.

    python benchmarks/fp8.py [--num-tokens 1024] [--num-prompts 64]

1. Weight bytes of the model as the kernel path holds it (fp8 projections, bf16 embeddings
   and norms) against the bf16 model.
2. Accuracy on real weights (SmolLM2-135M-Instruct): next-token distributions over a text,
   teacher-forced, of the fp8 model against the bf16 model: top-1 agreement and mean
   KL(bf16 || fp8). Beside it, in the same run, the same measures of the bf16 model against
   float32: the rounding bf16 itself costs, the floor to read the fp8 figures against. Run on
   the CPU path, whose dequantized weights are the kernel's up to summation order.
3. On a CUDA machine only: W1 decode throughput, fp8 against bf16 weights.
"""

from __future__ import annotations

import argparse

import torch
from torch.nn import functional as F

from worker import LLM
from worker.scheduler import ScheduledRequest, SchedulerOutput

TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels; stored programs made software a thing apart from hardware, and "
    "assemblers, compilers and operating systems each hid one more layer of detail. "
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "Les langues romanes descendent du latin vulgaire; el español, o português e l'italiano "
    "partagent une grande partie de leur vocabulaire. 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89. "
)


def weight_bytes(**kwargs) -> int:
    model = LLM(None, attention_backend="triton", device="cpu", enforce_eager=True, max_model_len=256,
                num_gpu_blocks_override=16, **kwargs).engine.runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def position_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32: the logits at every position, one chunked prefill step."""
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

    bf16, fp8 = weight_bytes(dtype="bfloat16"), weight_bytes(dtype="bfloat16", quantization="fp8")
    print(f"weights bf16 {bf16 / 2**20:8.1f} MiB   fp8 {fp8 / 2**20:8.1f} MiB   fp8 / bf16 {fp8 / bf16:.2f}x")

    common = dict(max_model_len=2048, num_gpu_blocks_override=160, device="cpu")
    ids = LLM(None, **common).get_tokenizer().encode(TEXT * 20)[: args.num_tokens]
    logits = {name: position_logits(LLM(None, dtype=dtype, **common, **extra), ids)
              for name, dtype, extra in (("float32", "float32", {}), ("bf16", "bfloat16", {}),
                                         ("fp8", "bfloat16", {"quantization": "fp8"}))}
    for name, (ref, other) in {"bf16 vs float32": ("float32", "bf16"), "fp8 vs bf16": ("bf16", "fp8"),
                               "fp8 vs float32": ("float32", "fp8")}.items():
        agree, kl = compare(logits[ref], logits[other])
        print(f"{name:<16} top-1 agreement {100 * agree:6.2f}%   mean KL {kl:.5f}   ({len(ids)} positions)")

    if torch.cuda.is_available():
        from worker.bench import run_engine
        from worker.bench_workload import RandomWorkload

        workload = RandomWorkload(num_prompts=args.num_prompts)
        engine_args = {"device": "cuda", "max_model_len": 2048, "max_num_seqs": 256}
        tok = {q: run_engine(None, "bfloat16", workload, {**engine_args, "quantization": q})["output_tokens_per_s"]
               for q in (None, "fp8")}
        print(f"W1 cuda bf16 {tok[None]:.1f}  fp8 {tok['fp8']:.1f} out tok/s   fp8 / bf16 {tok['fp8'] / tok[None]:.2f}x")


if __name__ == "__main__":
    main()
