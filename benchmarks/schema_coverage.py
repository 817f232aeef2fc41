"""How many JSON schemas guided decoding takes and follows: the 200 schemas of
benchmarks/data/schemas.jsonl (tool calls, extraction records, real APIs' objects, one keyword
each, recursive, deep and large ones), each asked for in a chat prompt on the default model
(bfloat16, greedy) with `guided_decoding={"json_schema": schema}`.

    python benchmarks/schema_coverage.py [--limit N] [--max-tokens 192] [--verbose] [--against REV]

Each schema ends in one of: refused by the API (SamplingParams raised), refused by the worker
(LLM.chat refused or failed that request, or its output was aborted), followed (valid JSON
that the `jsonschema` package validates against the schema, formats checked), truncated
(max_tokens reached first), invalid (ended, but not JSON or not valid against the schema).
All the schemas the API took go through the engine in one batch; one the worker refuses is
taken out and the rest run on. Only the public interface (SamplingParams, LLM.chat,
RequestsFailed) is used, so `--against REV` runs this same file on the code at git revision REV
(in a temporary worktree, a process of its own) and prints the two columns side by side.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jsonschema
from revisions import output_at  # benchmarks/revisions.py, beside this script

DATA = Path(__file__).resolve().parent / "data" / "schemas.jsonl"
VERDICTS = ("refused by the API", "refused by the worker", "followed", "truncated", "invalid")
PROMPT = "Reply with one JSON value that is valid against this JSON schema, and nothing else.\n\n{schema}"


@dataclass(frozen=True)
class Outcome:
    name: str
    verdict: str  # one of VERDICTS
    detail: str = ""  # why it was refused or invalid: the error's first line


def load_schemas(limit: int | None) -> list[tuple[str, dict[str, Any]]]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return [(row["name"], row["schema"]) for row in rows[:limit]]


def first_line(error: BaseException | str) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else ""
    return line if isinstance(error, (str, ValueError)) else f"{type(error).__name__}: {line}"


@functools.cache
def format_checker(validator_class: Any) -> jsonschema.FormatChecker:
    """The formats of the schema's draft, as `jsonschema` checks them, with date-time, time, uri
    and hostname added where the optional packages it would check them with are not installed
    (jsonschema's own FormatChecker() would check "time" as draft 3 did: no offset)."""
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(validator_class.FORMAT_CHECKER.checkers)
    label = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    added = {
        "date-time": _is_date_time,
        "time": lambda v: _is_date_time("1970-01-01T" + v if isinstance(v, str) else v),
        "uri": lambda v: not isinstance(v, str) or re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*:\S*", v) is not None,
        "hostname": lambda v: not isinstance(v, str) or re.fullmatch(rf"{label}(\.{label})*", v) is not None,
    }
    for name, check in added.items():
        if name not in checker.checkers:
            checker.checks(name, raises=ValueError)(check)
    return checker


def _is_date_time(value: object) -> bool:
    """RFC 3339's date-time: a full date, "T", a time with seconds and an offset."""
    if not isinstance(value, str):
        return True
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})", value):
        return False
    datetime.fromisoformat(value.upper().replace("Z", "+00:00"))  # ValueError: a field out of range
    return True


def judge(schema: dict[str, Any], output: Any) -> Outcome:
    """The verdict on one generated output (a CompletionOutput)."""
    if output.finish_reason == "abort":
        return Outcome("", "refused by the worker", "its output was aborted")
    if output.finish_reason == "length":
        return Outcome("", "truncated")
    try:
        value = json.loads(output.text)
    except json.JSONDecodeError as e:
        return Outcome("", "invalid", f"not JSON: {e}")
    validator_class = jsonschema.validators.validator_for(schema)
    validator = validator_class(schema, format_checker=format_checker(validator_class))
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    return Outcome("", "followed") if error is None else Outcome("", "invalid", first_line(error.message))


def chat_each(llm: Any, conversations: list[list[dict[str, str]]], params: list[Any]) -> list[Any]:
    """Every conversation's first output, or its error's first line (a str) where the worker
    refused or failed it: one batch, and a prompt that LLM.chat refuses by index is taken out
    and the batch run again; an error naming none runs each prompt alone."""
    from worker import RequestsFailed

    results: list[Any] = [None] * len(conversations)
    pending = list(range(len(conversations)))
    while pending:
        try:
            outputs = llm.chat([conversations[i] for i in pending], [params[i] for i in pending], use_tqdm=False)
        except RequestsFailed as e:
            outputs = [first_line(e.failures[k]) if k in e.failures else out for k, out in enumerate(e.outputs)]
        except ValueError as e:
            if (m := re.match(r"prompt (\d+): ", str(e))) is None or int(m[1]) >= len(pending):
                return _chat_alone(llm, conversations, params, results, pending)
            results[pending.pop(int(m[1]))] = first_line(str(e)[m.end():])
            continue
        for i, out in zip(pending, outputs, strict=True):
            results[i] = out if isinstance(out, str) else out.outputs[0]
        pending = []
    return results


def _chat_alone(llm: Any, conversations: list, params: list, results: list[Any], pending: list[int]) -> list[Any]:
    from worker import RequestsFailed

    for i in pending:
        try:
            results[i] = llm.chat([conversations[i]], [params[i]], use_tqdm=False)[0].outputs[0]
        except RequestsFailed as e:
            results[i] = first_line(e.failures[0])
        except Exception as e:  # noqa: BLE001 (whatever the worker raised, it did not take this one)
            results[i] = first_line(e)
    return results


def measure(limit: int | None, max_tokens: int) -> tuple[list[Outcome], float]:
    """Each schema's outcome, and the seconds the engine took over the batch."""
    from worker import LLM, SamplingParams

    outcomes: dict[str, Outcome] = {}
    taken: list[tuple[str, dict[str, Any], Any]] = []
    schemas = load_schemas(limit)
    for name, schema in schemas:
        try:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, guided_decoding={"json_schema": schema})
        except Exception as e:  # noqa: BLE001 (ValueError is a refusal; anything else, a refusal by crash)
            outcomes[name] = Outcome(name, "refused by the API", first_line(e))
            continue
        taken.append((name, schema, params))
    llm = LLM(None, dtype="bfloat16", max_model_len=4096, max_num_seqs=256)
    conversations = [[{"role": "user", "content": PROMPT.format(schema=json.dumps(schema, ensure_ascii=False, separators=(",", ":")))}]
                     for _, schema, _ in taken]
    start = time.perf_counter()
    results = chat_each(llm, conversations, [params for _, _, params in taken])
    seconds = time.perf_counter() - start
    for (name, schema, _), result in zip(taken, results, strict=True):
        if isinstance(result, str):
            outcomes[name] = Outcome(name, "refused by the worker", result)
        else:
            verdict = judge(schema, result)
            outcomes[name] = Outcome(name, verdict.verdict, verdict.detail)
    return [outcomes[name] for name, _ in schemas], seconds


def table(columns: dict[str, list[Outcome]]) -> list[str]:
    """Counts per verdict, one column per measured tree."""
    width = max(14, *(len(c) + 2 for c in columns))
    counts = {label: Counter(o.verdict for o in outcomes) for label, outcomes in columns.items()}
    lines = [f"{'':<24}" + "".join(f"{label:>{width}}" for label in columns)]
    lines.append(f"{'schemas':<24}" + "".join(f"{len(o):>{width}}" for o in columns.values()))
    accepted_api = {label: len(o) - counts[label]["refused by the API"] for label, o in columns.items()}
    accepted_worker = {label: accepted_api[label] - counts[label]["refused by the worker"] for label in columns}
    lines.append(f"{'accepted by the API':<24}" + "".join(f"{accepted_api[label]:>{width}}" for label in columns))
    lines.append(f"{'accepted by the worker':<24}" + "".join(f"{accepted_worker[label]:>{width}}" for label in columns))
    for verdict in ("followed", "truncated", "invalid"):
        lines.append(f"{verdict:<24}" + "".join(f"{counts[label][verdict]:>{width}}" for label in columns))
    return lines


def details(label: str, outcomes: list[Outcome]) -> list[str]:
    """The refused and invalid schemas, each with why."""
    lines = []
    for verdict in ("refused by the API", "refused by the worker", "invalid"):
        named = [o for o in outcomes if o.verdict == verdict]
        if named:
            lines.append(f"{label}: {verdict} ({len(named)})")
            lines += [f"  {o.name}: {o.detail}" for o in named]
    return lines


def outcomes_at(revision: str, limit: int | None, max_tokens: int) -> tuple[list[Outcome], float]:
    """This script's measurement on the code at `revision` (see revisions.output_at)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "outcomes.json"
        argv = ["--max-tokens", str(max_tokens), "--json-out", str(out)] + (["--limit", str(limit)] if limit else [])
        output_at(revision, Path(__file__), argv, own_copy=False)
        data = json.loads(out.read_text())
    return [Outcome(**o) for o in data["outcomes"]], data["seconds"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, help="only the first N schemas")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--verbose", action="store_true", help="list the refused and invalid schemas, each with why")
    ap.add_argument("--against", metavar="REV", help="first the same measurement on the code at this git revision")
    ap.add_argument("--json-out", type=Path, help=argparse.SUPPRESS)  # (how --against reads the other tree's)
    args = ap.parse_args()
    columns: dict[str, list[Outcome]] = {}
    seconds: dict[str, float] = {}
    if args.against:
        columns[args.against], seconds[args.against] = outcomes_at(args.against, args.limit, args.max_tokens)
    label = "this tree"
    columns[label], seconds[label] = measure(args.limit, args.max_tokens)
    if args.json_out:
        args.json_out.write_text(json.dumps({"outcomes": [asdict(o) for o in columns[label]], "seconds": seconds[label]}))
        return 0
    print("\n".join(table(columns)))
    print("engine seconds over the batch: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    if args.verbose and (lines := [line for k, outcomes in columns.items() for line in details(k, outcomes)]):
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
