"""The cost of building a guided-decoding mask: for each state a JSON-schema output passes
through, the default model's whole vocabulary (as bytes) is stepped through the grammar, once
per state (the engine caches the result).

    python benchmarks/grammar_masks.py [--repeats 3]

Prints milliseconds per mask (the best of the repeats), for a schema whose states cover keys,
strings, integers, an enum array and a union with null.
"""

from __future__ import annotations

import argparse
import time

from transformers import AutoTokenizer

from worker.json_grammar import JsonSchemaGrammar
from worker.model_loader import resolve_model_path
from worker.token_bytes import byte_text, token_bytes

SCHEMA = {
    "type": "object", "required": ["name", "age"],
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
        "email": {"type": ["string", "null"]},
    },
}
PIECES = ['{', '"', 'name', '"', ':', ' "', 'Ann', '"', ', "age": ', '3', ', "tags": [', '"a"', ']']


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    vocabulary = [byte_text(b) for b in token_bytes(tokenizer) if b]
    grammar = JsonSchemaGrammar(SCHEMA)
    states = [grammar.initial()]
    for piece in PIECES:
        states.append(grammar.advance(states[-1], piece))
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        for state in states:
            sum(1 for text in vocabulary if grammar.advance(state, text) is not None)
        best = min(best, time.perf_counter() - start)
    print(f"{len(states)} masks over {len(vocabulary)} tokens: {best * 1000 / len(states):.1f} ms per mask")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
