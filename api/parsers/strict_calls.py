"""OpenAI's strict tools under tool_choice "auto": the reply stays free, but each call it
opens is held to its tools, in the format the server reads calls in (GENQ_TOOL_CALL_PARSER),
by a structural tag (producer.grammar.structural_tag): a call's opening tag triggers it, the call's
head names one of the tools, its arguments are a JSON value of that tool's parameters (a
strict tool's; another's any object), and its closing follows.

- hermes: `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`
- deepseek_v31: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` (its section's tags free)
- deepseek_v3: the same tags, `function`, then the name on its line and the arguments fenced
- granite: `<|tool_call|>` and a JSON array of `{"name", "arguments"}` calls

Other formats (arguments as tagged pairs, Python calls, a section's numbered heads, a reply
that is all JSON) have no such tag: their calls are read as written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from api.parsers.section_tool_calls import FORMATS as SECTION_FORMATS
from api.parsers.tool_calls import calls_schema
from api.request_bodies import FunctionDefinition

Structures = list[dict[str, Any]]


def strict_calls(parser: str | None, functions: list[FunctionDefinition], parallel: bool) -> dict[str, Any] | None:
    """The structural tag that holds an auto reply's calls to `functions`, when one of them
    is strict and `parser`'s format has one; else None."""
    if parser not in FORMATS or not any(f.strict for f in functions):
        return None
    trigger, structures = FORMATS[parser]([(f.name, _arguments(f)) for f in functions], parallel)
    return {"structures": structures, "triggers": [trigger]}


def _arguments(function: FunctionDefinition) -> dict[str, Any]:
    return (function.parameters or {"type": "object"}) if function.strict else {"type": "object"}


def _hermes(tools: list[tuple[str, dict[str, Any]]], parallel: bool) -> tuple[str, Structures]:
    return "<tool_call>", [
        {"begin": '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ',
         "schema": schema, "end": "}\n</tool_call>"}
        for name, schema in tools
    ]


def _deepseek(fenced: bool) -> Callable[[list[tuple[str, dict[str, Any]]], bool], tuple[str, Structures]]:
    tags = SECTION_FORMATS["deepseek_v3" if fenced else "deepseek_v31"]

    def structures(tools: list[tuple[str, dict[str, Any]]], parallel: bool) -> tuple[str, Structures]:
        head, tail = ("function" + tags.sep + "{}\n```json\n", "\n```") if fenced else ("{}" + tags.sep, "")
        return tags.call, [{"begin": tags.call + head.format(name), "schema": schema, "end": tail + tags.call_end}
                           for name, schema in tools]

    return structures


def _granite(tools: list[tuple[str, dict[str, Any]]], parallel: bool) -> tuple[str, Structures]:
    return "<|tool_call|>", [{"begin": "<|tool_call|>", "schema": calls_schema(tools, parallel), "end": ""}]


FORMATS: dict[str, Callable[[list[tuple[str, dict[str, Any]]], bool], tuple[str, Structures]]] = {
    "hermes": _hermes, "deepseek_v31": _deepseek(fenced=False), "deepseek_v3": _deepseek(fenced=True),
    "granite": _granite,
}
