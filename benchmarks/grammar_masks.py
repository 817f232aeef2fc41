"""The cost of building a guided-decoding mask: for each state a JSON-schema output passes
through, the default model's whole vocabulary (as bytes) is stepped through the grammar, once
per state (the engine caches the result).

    python benchmarks/grammar_masks.py [--repeats 3] [--tools 20]

Prints milliseconds per mask (the best of the repeats) for a schema whose states cover keys,
strings, integers, an enum array and a union with null; then for tool_choice "required" over
`--tools` tools (an array of calls, each `{"name": <const>, "arguments": ...}`), through the
tool's name; then for a regular expression (guided_regex), cold (its DFA states are built as
the vocabulary walks them, once per pattern and process) and warm.
"""

from __future__ import annotations

import argparse
import time

from transformers import AutoTokenizer

from api.tool_calls import calls_schema
from worker.json_schema_grammar import JsonSchemaGrammar
from worker.model_loader import resolve_model_path
from worker.structured_output import Grammar, RegexGrammar
from worker.token_bytes import byte_text, token_bytes

SCHEMA = {
    "type": "object", "required": ["name", "age"],
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
        "email": {"type": ["string", "null"]},
    },
}
TOOL_PIECES = ['[', '{', '"', 'name', '"', ':', ' "', 'tool', '_', '1', '7']
PIECES = ['{', '"', 'name', '"', ':', ' "', 'Ann', '"', ', "age": ', '3', ', "tags": [', '"a"', ']']
REGEX = r"[\w.+-]{1,32}@[a-z0-9-]{1,20}\.(com|org|net)|\(\d{3}\) \d{3}-\d{4}"
REGEX_PIECES = ['john', '.', 'doe', '@', 'mail', '.', 'co']


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tools", type=int, default=20)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    vocabulary = [byte_text(b) for b in token_bytes(tokenizer) if b]
    parameters = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    tools = calls_schema([(f"tool_{i}", parameters) for i in range(args.tools)], parallel=True)
    for name, schema, pieces in (("schema", SCHEMA, PIECES), (f"{args.tools} tools", tools, TOOL_PIECES)):
        per_mask = time_masks(JsonSchemaGrammar(schema), pieces, vocabulary, args.repeats)
        print(f"{name}: {len(pieces) + 1} masks over {len(vocabulary)} tokens: {per_mask * 1000:.1f} ms per mask")
    regex = RegexGrammar(REGEX)
    cold = time_masks(regex, REGEX_PIECES, vocabulary, 1)
    warm = time_masks(regex, REGEX_PIECES, vocabulary, args.repeats)
    print(f"regex: {len(REGEX_PIECES) + 1} masks over {len(vocabulary)} tokens: {cold * 1000:.1f} ms per mask cold, "
          f"{warm * 1000:.1f} ms warm")
    return 0


def time_masks(grammar: Grammar, pieces: list[str], vocabulary: list[str], repeats: int) -> float:
    """Seconds per mask, best of `repeats`, over the states `pieces` lead through."""
    states = [grammar.initial()]
    for piece in pieces:
        states.append(grammar.advance(states[-1], piece))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for state in states:
            sum(1 for text in vocabulary if grammar.advance(state, text) is not None)
        best = min(best, time.perf_counter() - start)
    return best / len(states)


if __name__ == "__main__":
    raise SystemExit(main())
