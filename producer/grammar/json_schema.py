"""JSON Schema keywords the worker's grammar engine (xgrammar) reads past without holding the
output to them: a schema that uses one is refused before its job is queued, naming the keyword
and where it is, since the output could break it (the rest of JSON Schema is xgrammar's to
take or refuse, in the worker).

Measured with xgrammar 0.2.9 (a text breaking the keyword is taken): `uniqueItems`, `not`,
`if`/`then`/`else`, `dependentRequired`, `dependentSchemas` (and draft 7's `dependencies`),
`contains` (with `minContains`/`maxContains`), `allOf` of more than one schema (the
`required` of its branches is lost), `multipleOf` anywhere but on `type: integer` with a
whole number, `minLength` / `maxLength` beside a `pattern` or a `format`, and a lookaround
(`(?=`, `(?!`, `(?<=`, `(?<!`) in a `pattern`. Not refused: a `oneOf` whose branches xgrammar
cannot prove disjoint, which it follows as `anyOf` (a value may fit two branches); telling
those apart is xgrammar's own analysis.

`for_xgrammar` rewrites two forms xgrammar refuses although JSON Schema allows them.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

UNENFORCED = ("uniqueItems", "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
              "contains", "minContains", "maxContains")
LOOKAROUND = re.compile(r"(?<!\\)\(\?<?[=!]")  # (?= (?! (?<= (?<!, not escaped
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMAS = ("items", "additionalProperties", "additionalItems", "propertyNames", "unevaluatedProperties",
            "unevaluatedItems")


def check_enforceable(schema: Any, where: str = "#") -> None:
    """ValueError naming the first keyword of `schema` (or of a schema inside it) the grammar
    engine would not hold the output to."""
    if not isinstance(schema, dict):
        return
    for keyword in UNENFORCED:
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            raise ValueError(f"{where}: {keyword} is not supported (the output would not be held to it)")
    multiple = schema.get("multipleOf")
    if multiple is not None and not (schema.get("type") == "integer" and isinstance(multiple, int | float)
                                     and float(multiple).is_integer()):
        raise ValueError(f"{where}: multipleOf {multiple} is not supported (only a whole number, on type integer)")
    if ("minLength" in schema or "maxLength" in schema) and ("pattern" in schema or "format" in schema):
        beside = "pattern" if "pattern" in schema else "format"
        raise ValueError(f"{where}: minLength/maxLength beside {beside} is not supported (write the length "
                         f"into the pattern)")
    if isinstance(schema.get("pattern"), str) and LOOKAROUND.search(schema["pattern"]):
        raise ValueError(f"{where}: a lookaround in pattern is not supported")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise ValueError(f"{where}: allOf of more than one schema is not supported (merge them into one)")
    for sub, at in _subschemas(schema, where):
        check_enforceable(sub, at)


def for_xgrammar(schema: Any) -> Any:
    """A copy of `schema` with two forms xgrammar (0.2.9) misreads written as it reads them,
    the meaning kept:
    - draft 4's boolean `exclusiveMinimum` / `exclusiveMaximum` beside `minimum` / `maximum`
      ("Value must be a number"): the bound itself, as draft 6 on write it;
    - an array with more `minItems` than `prefixItems` and no `items`, which xgrammar's strict
      mode reads as "no more items" and so refuses: `items: {}`, any value, as JSON Schema
      means by no `items`."""
    out = copy.deepcopy(schema)
    _rewrite_for_xgrammar(out)
    return out


def _rewrite_for_xgrammar(schema: Any) -> None:
    if not isinstance(schema, dict):
        return
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(schema.get(exclusive), bool) and schema.pop(exclusive) and bound in schema:
            schema[exclusive] = schema.pop(bound)
    prefix, least = schema.get("prefixItems"), schema.get("minItems")
    if ("items" not in schema and "additionalItems" not in schema and isinstance(least, int)
            and least > (len(prefix) if isinstance(prefix, list) else 0)):
        schema["items"] = {}
    for sub, _ in _subschemas(schema, "#"):
        _rewrite_for_xgrammar(sub)


def _subschemas(schema: dict[str, Any], where: str) -> Iterator[tuple[Any, str]]:
    """Each schema directly inside `schema`, with where it is."""
    for key in _SCHEMA_MAPS:
        for name, sub in schema[key].items() if isinstance(schema.get(key), dict) else ():
            yield sub, f"{where}/{key}/{name}"
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(schema[key]) if isinstance(schema.get(key), list) else ():
            yield sub, f"{where}/{key}/{i}"
    for key in _SCHEMAS:
        sub = schema.get(key)
        if isinstance(sub, list):  # (draft 4's tuple items)
            for i, item in enumerate(sub):
                yield item, f"{where}/{key}/{i}"
        else:
            yield sub, f"{where}/{key}"
