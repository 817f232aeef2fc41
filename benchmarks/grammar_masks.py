"""The cost of building a guided-decoding mask: for each state a JSON-schema output passes
through, the tokens of the default model's vocabulary that the grammar takes, found as the
engine finds them (down a trie of the vocabulary, one character at a time) and, as the
baseline in the same run, by stepping every token's bytes through the grammar. The engine
caches each state's mask; here each is built afresh.

    python benchmarks/grammar_masks.py [--repeats 3] [--tools 20]

Prints milliseconds per mask (the best of the repeats) both ways and their ratio, for a schema
whose states cover keys, strings, integers, an enum array and a union with null; then for
tool_choice "required" over `--tools` tools (an array of calls, each `{"name": <const>,
"arguments": ...}`), through the tool's name; then for a regular expression (guided_regex)
and an EBNF grammar (structured_outputs grammar), cold (their automata's states are built as
the trie walks them, once per pattern or grammar and process) and warm.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Hashable

from transformers import AutoTokenizer

from api.parsers.tool_calls import calls_schema
from worker.guided.json_schema_grammar import JsonSchemaGrammar
from worker.guided.structured_output import (
    Grammar,
    GuidedState,
    TokenMasks,
    ebnf_grammar,
    regex_grammar,
)
from worker.guided.token_bytes import byte_text, token_bytes
from worker.model_executor.model_loader import resolve_model_path

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
EBNF = r"""
root ::= "SELECT " columns " FROM " [a-z_]+ (" WHERE " condition (" AND " condition)*)? ";"
columns ::= "*" | column (", " column)*
column ::= [a-z_] [a-z_0-9]* | "\"" [^"\n]+ "\""
condition ::= column (" = " | " < " | " > ") ([0-9]+ | "'" [^'\n]* "'")
"""
EBNF_PIECES = ['SELECT', ' name', ',', ' "', 'full name', '"', ' FROM', ' people', ' WHERE', ' age', ' >', ' ', '30']


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tools", type=int, default=20)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    vocabulary = token_bytes(tokenizer)
    masks = TokenMasks(vocabulary, stop_ids=set(), cache_size=0)  # every mask built afresh
    texts = [byte_text(b) for b in vocabulary if b]
    parameters = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    tools = calls_schema([(f"tool_{i}", parameters) for i in range(args.tools)], parallel=True)
    def down_the_trie(grammar: Grammar, state: Hashable) -> bytes:
        return masks.allowed(GuidedState(grammar, state))

    def every_token(grammar: Grammar, state: Hashable) -> list[str]:
        return [t for t in texts if grammar.advance(state, t) is not None]

    regex, ebnf = regex_grammar(REGEX), ebnf_grammar(EBNF)
    cold = time_masks(regex, REGEX_PIECES, down_the_trie, 1)
    ebnf_cold = time_masks(ebnf, EBNF_PIECES, down_the_trie, 1)
    for name, grammar, pieces in (("schema", JsonSchemaGrammar(SCHEMA), PIECES),
                                  (f"{args.tools} tools", JsonSchemaGrammar(tools), TOOL_PIECES),
                                  ("regex (warm)", regex, REGEX_PIECES), ("grammar (warm)", ebnf, EBNF_PIECES)):
        trie = time_masks(grammar, pieces, down_the_trie, args.repeats)
        every = time_masks(grammar, pieces, every_token, args.repeats)
        print(f"{name}: {len(pieces) + 1} masks over {len(texts)} tokens: {trie * 1000:.1f} ms per mask down the trie, "
              f"{every * 1000:.1f} ms checking every token ({every / trie:.1f}x)")
    print(f"regex cold: {cold * 1000:.1f} ms per mask down the trie")
    print(f"grammar cold: {ebnf_cold * 1000:.1f} ms per mask down the trie")
    return 0


def time_masks(grammar: Grammar, pieces: list[str], build: Callable[[Grammar, Hashable], object], repeats: int) -> float:
    """Seconds per mask, best of `repeats`, over the states `pieces` lead through."""
    states = [grammar.initial()]
    for piece in pieces:
        states.append(grammar.advance(states[-1], piece))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for state in states:
            build(grammar, state)
        best = min(best, time.perf_counter() - start)
    return best / len(states)


if __name__ == "__main__":
    raise SystemExit(main())
