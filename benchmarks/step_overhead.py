"""What an engine step costs on the host, apart from the model: the engine runs a tiny model
(two layers of width 64, SmolLM2's tokenizer and vocabulary, seeded random weights) on the CPU,
so its time per decode step is mostly scheduling, input preparation, sampling and
detokenization, which on a GPU the model does not hide (the H200 check's W1: about 12 ms a
step for 128 sequences of SmolLM2-135M, graphs 3.1x eager). Then the detokenizer alone, its
windows decoded by the Rust tokenizer against transformers' `decode`, in the same run.

    python benchmarks/step_overhead.py [--num-seqs 128] [--output-len 128] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import tempfile
import time
from pathlib import Path

from gpu_check import remake  # benchmarks/gpu_check.py, beside this script

from worker import LLM, SamplingParams
from worker.core.detokenizer import IncrementalDetokenizer


def tiny_model(out: Path) -> str:
    return remake(None, None, out, num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)


def engine_steps(model: str, num_seqs: int, output_len: int, profile: bool) -> str:
    llm = LLM(model, dtype="float32", device="cpu", load_format="dummy", max_model_len=1024, max_num_seqs=num_seqs)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)  # warm-up
    engine = llm.engine
    for i in range(num_seqs):
        engine.add_request(str(i), {"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(48)]}, params)
    engine.step()  # the prefill
    profiler = cProfile.Profile() if profile else None
    steps, start = 0, time.perf_counter()
    if profiler:
        profiler.enable()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    return f"engine: {steps} steps after the first, {num_seqs} sequences, {elapsed / steps * 1e3:.2f} ms a step"


def detokenizer_cost(model: str, num_seqs: int, output_len: int) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(1)
    outputs = [[rng.randrange(3, 49152) for _ in range(output_len)] for _ in range(num_seqs)]
    params = SamplingParams(max_tokens=output_len)
    results = {}
    for path in ("transformers' decode", "Rust decode"):
        start, texts = time.perf_counter(), []
        for ids in outputs:
            detok = IncrementalDetokenizer(tokenizer, [], params)
            if path == "transformers' decode":
                detok._rust_decode = None  # the wrapper, as before
            for token in ids:
                detok.update([token])
            detok.flush()
            texts.append(detok.output_text)
        results[path] = ((time.perf_counter() - start) / (num_seqs * output_len), texts)
    (slow, slow_texts), (fast, fast_texts) = results.values()
    return [f"detokenizer, a token: transformers' decode {slow * 1e6:.1f} us, Rust decode {fast * 1e6:.1f} us "
            f"({slow / fast:.2f}x); texts equal: {slow_texts == fast_texts}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="print where the engine's steps went (cProfile)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        print(engine_steps(model, args.num_seqs, args.output_len, args.profile))
        print("\n".join(detokenizer_cost(model, args.num_seqs, args.output_len)))


if __name__ == "__main__":
    main()
