"""What an engine step costs on the host, apart from the model: the engine runs a tiny model
(two layers of width 64, SmolLM2's tokenizer and vocabulary, seeded random weights) on the CPU,
so its time per decode step is mostly scheduling, input preparation, sampling and
detokenization, which on a GPU the model does not hide (the H200 check's W1: about 12 ms a
step for 128 sequences of SmolLM2-135M, graphs 3.1x eager). Then the detokenizer alone, its
windows decoded by the Rust tokenizer against transformers' `decode`, in the same run.

Where a step's host time goes, phase by phase, for 128, 256 and 512 sequences: each phase is
the exclusive time of the engine's own calls (schedule; prepare inputs, attention metadata
included; the model's forward and LM head; the rest of execute; sampling's host side, its
batch of parameters; the sampler's arithmetic; update; output processing, detokenization and
stop checks; proposing), and "host" is a step less the forward and the sampling arithmetic:
what a GPU would not hide. (The queue path's publish runs in the worker's event loop beside
the engine thread: benchmarks/throughput.py's queue mode times it.)

The engine steps with the objects of its start frozen out of the collector's full passes, as
a worker's do (worker.queue.consumer's _freeze_start); `--no-freeze` leaves them in, as before.

With `--against REV` the same tables are printed first for the code at git revision REV (in a
temporary worktree, run in a process of its own), then for this tree's: a before and after
measured in one run, since this CPU's speed drifts from day to day.

    python benchmarks/step_overhead.py [--num-seqs 128,256,512] [--output-len 128] [--profile] [--against REV]
        [--no-freeze]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import pstats
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpu_check import remake  # benchmarks/gpu_check.py, beside this script
from revisions import output_at

from worker import LLM, SamplingParams
from worker.core.detokenizer import IncrementalDetokenizer


def tiny_model(out: Path) -> str:
    return remake(None, None, out, num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)


@contextlib.contextmanager
def frozen_start() -> Iterator[None]:
    """What a worker does once its engine is built (worker.queue.consumer._freeze_start): the objects
    made so far leave the collector's full passes; given back after, so the engine can go."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.collect()


def decoding_engine(model: str, num_seqs: int, output_len: int) -> Any:
    """An engine holding `num_seqs` greedy requests of 48 random prompt tokens, prefilled."""
    llm = LLM(model, dtype="float32", device="cpu", load_format="dummy", max_model_len=1024, max_num_seqs=num_seqs,
              max_num_batched_tokens=max(2048, 48 * num_seqs))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)  # warm-up
    engine = llm.engine
    for i in range(num_seqs):
        engine.add_request(str(i), {"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(48)]}, params)
    engine.step()  # the prefill
    return engine


FREEZE = True  # (--no-freeze: the collector's full passes walk the start's objects too)


def engine_steps(model: str, num_seqs: int, output_len: int, profile: bool) -> str:
    engine = decoding_engine(model, num_seqs, output_len)
    profiler = cProfile.Profile() if profile else None
    steps, start = 0, time.perf_counter()
    if profiler:
        profiler.enable()
    with frozen_start() if FREEZE else contextlib.nullcontext():
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    elapsed = time.perf_counter() - start
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    return f"engine: {steps} steps after the first, {num_seqs} sequences, {elapsed / steps * 1e3:.2f} ms a step"


class Phases:
    """Exclusive wall time per phase: a timed call's time less that of the timed calls inside it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._inner: list[float] = []  # per open call: time its timed callees took

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._inner.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                inner = self._inner.pop()
                self.seconds[name] = self.seconds.get(name, 0.0) + took - inner
                if self._inner:
                    self._inner[-1] += took
        return timed


class TimedSampler:
    """The engine's sampler, its calls timed (its other attributes read through)."""

    def __init__(self, sampler: Any, phases: Phases) -> None:
        self._sampler = sampler
        self._call = phases.wrap("sampling arithmetic", sampler.__call__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler, name)


PHASES = [  # (name, object path under the engine, method)
    ("schedule", "scheduler", "schedule"),
    ("prepare inputs", "runner", "_prepare"),
    ("model forward", "runner.model", "forward"),
    ("LM head", "runner.model", "compute_logits"),
    ("execute, rest", "runner", "execute"),
    ("sampling, host", "", "_sample"),
    ("update", "scheduler", "update_from_output"),
    ("output processing", "output_processor", "process"),
    ("propose", "speculator", "propose"),
    ("encode images", "runner", "encode_images"),
    ("finish requests", "scheduler", "finish_requests"),
    ("forget ended", "", "_forget"),
    ("take aborted", "", "_take_aborted"),
    ("step", "", "step"),
]
DEVICE_WORK = ("model forward", "LM head", "sampling arithmetic")  # what a GPU's kernels would do


def phase_times(model: str, num_seqs: int, output_len: int) -> tuple[int, dict[str, float]]:
    """Steps timed and each phase's exclusive seconds over them (the instance's methods wrapped)."""
    engine = decoding_engine(model, num_seqs, output_len)
    phases = Phases()
    for name, path, method in PHASES:
        owner = engine
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        setattr(owner, method, phases.wrap(name, getattr(owner, method)))
    engine.sampler = TimedSampler(engine.sampler, phases)
    steps = 0
    with frozen_start() if FREEZE else contextlib.nullcontext():
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    return steps, phases.seconds


def phase_table(model: str, sizes: list[int], output_len: int) -> list[str]:
    results = {n: phase_times(model, n, output_len) for n in sizes}
    names = [name for name, _, _ in PHASES if name != "step"] + ["sampling arithmetic", "step, rest"]
    lines = ["ms a step           " + "".join(f"{n:>10} seqs" for n in sizes)]
    per_step = {n: {k: v / steps * 1e3 for k, v in seconds.items()} for n, (steps, seconds) in results.items()}
    for name in names:
        key = "step" if name == "step, rest" else name
        lines.append(f"{name:<20}" + "".join(f"{per_step[n].get(key, 0.0):>15.2f}" for n in sizes))
    total = {n: sum(per_step[n].values()) for n in sizes}
    host = {n: total[n] - sum(per_step[n].get(k, 0.0) for k in DEVICE_WORK) for n in sizes}
    lines.append(f"{'whole step':<20}" + "".join(f"{total[n]:>15.2f}" for n in sizes))
    lines.append(f"{'host (not device)':<20}" + "".join(f"{host[n]:>15.2f}" for n in sizes))
    lines.append(f"{'host per sequence':<20}" + "".join(f"{host[n] / n * 1e3:>12.2f} us" for n in sizes))
    return lines


def detokenizer_cost(model: str, num_seqs: int, output_len: int) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(1)
    outputs = [[rng.randrange(3, 49152) for _ in range(output_len)] for _ in range(num_seqs)]
    params = SamplingParams(max_tokens=output_len)
    results = {}
    for path in ("transformers' decode", "Rust decode", "own texts"):
        start, texts = time.perf_counter(), []
        for ids in outputs:
            detok = IncrementalDetokenizer(tokenizer, [], params)
            if path != "own texts":
                detok._own_texts = None  # a window decoded for every token, as before
            if path == "transformers' decode":
                detok._rust_decode = None  # the wrapper, as before that
            for token in ids:
                detok.update([token])
            detok.flush()
            texts.append(detok.output_text)
        results[path] = ((time.perf_counter() - start) / (num_seqs * output_len), texts)
    (slow, slow_texts), (rust, rust_texts), (own, own_texts) = results.values()
    return [f"detokenizer, a token: transformers' decode {slow * 1e6:.1f} us, Rust decode {rust * 1e6:.1f} us "
            f"({slow / rust:.2f}x), a byte-level token's own text {own * 1e6:.1f} us ({rust / own:.2f}x); "
            f"texts equal: {slow_texts == rust_texts == own_texts}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", default="128,256,512", help="comma-separated: the phase table's batch sizes "
                    "(the first also times whole steps, the detokenizer and --profile)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="print where the engine's steps went (cProfile)")
    ap.add_argument("--against", metavar="REV", help="first the same tables for the code at this git revision")
    ap.add_argument("--no-freeze", action="store_true", help="leave the objects of the engine's start in the "
                    "collector's full passes (a worker freezes them once started)")
    args = ap.parse_args()
    global FREEZE
    FREEZE = not args.no_freeze
    if args.against:
        argv = ["--num-seqs", args.num_seqs, "--output-len", str(args.output_len)]
        print(f"== {args.against}\n" + output_at(args.against, Path(__file__), argv), end="")
        print("== this tree")
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        sizes = [int(n) for n in args.num_seqs.split(",")]
        print(engine_steps(model, sizes[0], args.output_len, args.profile))
        print("\n".join(phase_table(model, sizes, args.output_len)))
        print("\n".join(detokenizer_cost(model, sizes[0], args.output_len)))


if __name__ == "__main__":
    main()
