"""Generate with the default model and print the text as it streams: `python -m benchmarks.demo`."""

from __future__ import annotations

import argparse
import sys

from producer.sampling_params import SamplingParams
from worker.config import EngineConfig
from worker.core.engine import Engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("prompt", nargs="?", default="Explain in two sentences why the sky is blue.")
    ap.add_argument("--model", default=None, help="local model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=2048))
    prompt = engine.inputs.apply_chat_template([{"role": "user", "content": args.prompt}])
    engine.add_request("demo", prompt, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
    print(f"> {args.prompt}\n", flush=True)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].text)
            sys.stdout.flush()
            if out.finished:
                print(f"\n\n[finish_reason={out.outputs[0].finish_reason}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
