"""The cost of guided decoding: the same chat prompts on the default model, free and with
`guided_decoding={"json_object": True}`, in one run; `--guide json_schema` asks for a value of a
schema (an object with a name, an integer, a list of tags and a nested object), `--guide
compact` for compact JSON (disable_any_whitespace), `--guide ebnf` for JSON objects by an
EBNF grammar (xgrammar's JSON grammar).

    python benchmarks/guided.py [--prompts 16] [--max-tokens 96] [--dtype bfloat16] [--guide json_object]
        [--against REV]

With `--against REV` the same measurement (this script, which uses only the offline `LLM`)
runs first on the code at git revision REV, in a process of its own: before and after in one
run.

Both runs use ignore_eos off and stop where the model (or the grammar) ends, so it prints
seconds per output token for each: the guided figure includes building masks for states the
cache has not seen (the first run of a process sees all of them) and applying them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from revisions import output_at  # benchmarks/revisions.py, beside this script

from worker import LLM, SamplingParams

JSON_EBNF = r"""
root ::= object
value ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ws ( string ws ":" ws value ( ws "," ws string ws ":" ws value )* )? ws "}"
array ::= "[" ws ( value ( ws "," ws value )* )? ws "]"
string ::= "\"" ( [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""
number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
ws ::= [ \t\n]{0,20}
"""
SCHEMA = {"type": "object", "required": ["name", "count", "tags", "details"], "properties": {
    "name": {"type": "string"}, "count": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "details": {"type": "object", "properties": {"colour": {"type": "string"}, "size": {"enum": ["small", "large"]}}}}}
GUIDES = {
    "json_object": {"json_object": True},
    "json_schema": {"json_schema": SCHEMA},
    "compact": {"json_object": True, "disable_any_whitespace": True},
    "ebnf": {"grammar": JSON_EBNF},
}
TOPICS = ["a cat", "a city", "a book", "a car", "a planet", "a song", "a river", "a chair"]


def run(llm: LLM, messages: list, params: SamplingParams) -> tuple[float, int, list]:
    start = time.perf_counter()
    outs = [o.outputs[0] for o in llm.chat(messages, params, use_tqdm=False)]
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs), outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--guide", choices=sorted(GUIDES), default="json_object")
    ap.add_argument("--against", metavar="REV", help="first the same run on the code at this git revision")
    args = ap.parse_args()
    if args.against:
        argv = [a for a in sys.argv[1:] if a not in ("--against", args.against)]
        print(f"== {args.against}\n" + output_at(args.against, Path(__file__), argv, own_copy=False) + "== this tree")
    llm = LLM(None, dtype=args.dtype, max_model_len=1024)
    messages = [
        [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as a JSON object ({i})."}]
        for i in range(args.prompts)
    ]
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    guided = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, guided_decoding=GUIDES[args.guide])
    run(llm, messages[:2], free)  # warm-up: first-call costs outside the timings
    rows = []
    for name, params in (("free", free), ("guided, cold cache", guided), ("guided, warm cache", guided)):
        seconds, tokens, outs = run(llm, messages, params)
        parsed = sum(1 for o in outs if _is_object(o.text))
        rows.append((name, seconds, tokens, parsed))
    print(f"{'run':<20} {'s':>7} {'tokens':>7} {'ms/token':>9} {'JSON objects':>13}")
    for name, seconds, tokens, parsed in rows:
        print(f"{name:<20} {seconds:7.2f} {tokens:7d} {1000 * seconds / tokens:9.2f} {parsed:>7d}/{args.prompts}")
    base = rows[0][1] / rows[0][2]
    for name, seconds, tokens, _ in rows[1:]:
        print(f"{name}: {seconds / tokens / base:.2f}x the free run's time per token")
    return 0


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
