"""Structural tags for guided decoding (vLLM's `structural_tag`, `response_format` of type
`structural_tag`): the output is free text, except that once it writes one of the
`triggers`, it must go on with one of the `structures` that begin with it: the structure's
`begin` text, a JSON value of its `schema`, its `end` text; then free text again. This is how
a model's tool calls are held to their functions' parameters while it may still write prose
around them (`<function=get_weather>{"city": "Paris"}</function>`).

    {"structures": [{"begin": "<function=get_weather>", "schema": {...}, "end": "</function>"}],
     "triggers": ["<function="]}

vLLM hands this form to xgrammar (its `StructuralTagItem`s and triggers), and so does genq:
the worker runs it as xgrammar's triggered tags (`worker.guided.structured_output`). xgrammar's
own form, `{"format": {...}}` (a tree of tags, JSON schemas, sequences...), is passed on as
given. Its shape is checked here, before a job is queued (each schema is compiled by the
worker, which fails the job naming what it cannot compile). Plain Python, no dependencies.
"""

from __future__ import annotations

import json
from typing import Any

from producer.grammar.json_schema import check_enforceable


def read_structural_tag(spec: Any) -> dict[str, Any]:
    """`{"structures": [...], "triggers": [...]}` from the request's mapping or its JSON text
    (other keys, such as response_format's `type`, dropped); ValueError naming what is wrong."""
    spec = _json_object(spec)
    if "format" in spec:  # xgrammar's own form: the worker's xgrammar checks the tree
        if not isinstance(spec["format"], dict):
            raise ValueError(f"structural_tag format must be an object, got {type(spec['format']).__name__}")
        return {"format": spec["format"]}
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag structures must be a non-empty list of {begin, schema, end}")
    out = [_structure(i, s, triggers) for i, s in enumerate(structures)]
    begins = [s["begin"] for s in out]
    for i, begin in enumerate(begins):
        clash = next((b for b in begins[:i] if b.startswith(begin) or begin.startswith(b)), None)
        if clash is not None:
            raise ValueError(
                f"structural_tag structures[{i}]: begin {begin!r} and {clash!r} cannot be told apart (one begins the other)"
            )
    for trigger in triggers:
        if not any(b.startswith(trigger) for b in begins):
            raise ValueError(f"structural_tag trigger {trigger!r} begins none of the structures")
        if any(other != trigger and trigger.startswith(other) for other in triggers):
            raise ValueError(f"structural_tag trigger {trigger!r} begins with another trigger, which always comes first")
    return {"structures": out, "triggers": list(triggers)}


def _json_object(spec: Any) -> dict[str, Any]:
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            raise ValueError("structural_tag must be a JSON object or its text") from None
    if not isinstance(spec, dict):
        raise ValueError(f"structural_tag must be a JSON object, got {type(spec).__name__}")
    return spec


def _structure(i: int, structure: Any, triggers: list[str]) -> dict[str, Any]:
    where = f"structural_tag structures[{i}]"
    if not isinstance(structure, dict) or set(structure) - {"begin", "schema", "end"}:
        raise ValueError(f"{where} must be an object of begin, schema and end")
    begin, schema, end = structure.get("begin"), structure.get("schema", {"type": "object"}), structure.get("end", "")
    if not isinstance(begin, str) or not isinstance(end, str):
        raise ValueError(f"{where}: begin and end must be strings")
    if not any(begin.startswith(t) for t in triggers):
        raise ValueError(f"{where}: begin {begin!r} starts with none of the triggers")
    if not isinstance(schema, dict | bool):
        raise ValueError(f"{where}: schema must be a JSON schema (an object), got {type(schema).__name__}")
    try:
        check_enforceable(schema)
    except ValueError as exc:
        raise ValueError(f"{where} schema: {exc}") from None
    return {"begin": begin, "schema": schema, "end": end}
