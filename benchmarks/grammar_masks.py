"""The cost of guided decoding's masks (worker.guided.structured_output, on xgrammar) over the
default model's vocabulary: for a JSON schema, tool_choice "required" over `--tools` tools (an
array of calls, each `{"name": <const>, "arguments": ...}`), a regular expression and an EBNF
grammar, the time to compile the grammar (once per guide: the engine keeps what it compiled;
it runs beside the engine's steps while the request's prompt is computed) and the time per mask along an output's states,
with a fresh matcher each repeat (nothing is cached per state: what compiling sorted ahead of
time is all there is).

    python benchmarks/grammar_masks.py [--repeats 3] [--tools 20]

Before xgrammar (git revisions before issue 50), this script timed genq's own automata: a
mask built down a trie of the vocabulary, 6-40 ms per new grammar state (cold), cached per
state after that.
"""

from __future__ import annotations

import argparse
import time

from transformers import AutoTokenizer

from api.parsers.tool_calls import calls_schema
from worker.guided.structured_output import GuidedDecoding
from worker.model_executor.model_loader import resolve_model_path

SCHEMA = {
    "type": "object", "required": ["name", "age"],
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
        "email": {"type": ["string", "null"]},
    },
}
TEXT = '{"name": "Ann", "age": 3, "tags": ["a"]}'
TOOL_TEXT = '[{"name": "tool_17", "arguments": {"a": 4}}]'
REGEX = r"[\w.+-]{1,32}@[a-z0-9-]{1,20}\.(com|org|net)|\(\d{3}\) \d{3}-\d{4}"
REGEX_TEXT = "john.doe@mail.com"
EBNF = r"""
root ::= "SELECT " columns " FROM " [a-z_]+ (" WHERE " condition (" AND " condition)*)? ";"
columns ::= "*" | column (", " column)*
column ::= [a-z_] [a-z_0-9]* | "\"" [^"\n]+ "\""
condition ::= column (" = " | " < " | " > ") ([0-9]+ | "'" [^'\n]* "'")
"""
EBNF_TEXT = 'SELECT name, "full name" FROM people WHERE age > 30;'


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tools", type=int, default=20)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    guided = GuidedDecoding(tokenizer, {tokenizer.eos_token_id}, len(tokenizer))
    start = time.perf_counter()
    guided.compile({"regex": "x"}).compiled.result()  # the vocabulary read once per engine (its first guided request)
    print(f"vocabulary of {len(tokenizer)} tokens read in {(time.perf_counter() - start) * 1000:.0f} ms (once per engine)")
    parameters = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    tools = calls_schema([(f"tool_{i}", parameters) for i in range(args.tools)], parallel=True)
    for name, spec, text in (("schema", {"json_schema": SCHEMA}, TEXT),
                             (f"{args.tools} tools", {"json_schema": tools}, TOOL_TEXT),
                             ("regex", {"regex": REGEX}, REGEX_TEXT), ("grammar", {"grammar": EBNF}, EBNF_TEXT)):
        compile_s, mask_s, num_masks = time_grammar(guided, spec, tokenizer.encode(text), args.repeats)
        print(f"{name}: compiled in {compile_s * 1000:.1f} ms; {num_masks} masks over {len(tokenizer)} tokens: "
              f"{mask_s * 1000:.3f} ms per mask (the token taken in, the mask filled)")
    return 0


def time_grammar(guided: GuidedDecoding, spec: dict, output: list[int], repeats: int) -> tuple[float, float, int]:
    """Seconds to compile `spec` afresh, and per mask (best of `repeats`) at each state along
    `output`; the number of masks."""
    guided._compiled.clear()  # (what the engine keeps of the guides it compiled)
    start = time.perf_counter()
    grammar = guided.compile(spec)
    grammar.compiled.result()  # (compiled in the background: a request's prompt is computed meanwhile)
    compile_s = time.perf_counter() - start
    best = float("inf")
    for repeat in range(repeats):
        request_id = f"r{repeat}"
        guided.add(request_id, grammar)
        start = time.perf_counter()
        for n in range(len(output) + 1):
            guided.masks([(request_id, output[:n], 0)])
        best = min(best, time.perf_counter() - start)
        guided.remove(request_id)
    return compile_s, best / (len(output) + 1), len(output) + 1


if __name__ == "__main__":
    raise SystemExit(main())
