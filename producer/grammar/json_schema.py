"""JSON Schema keywords the worker's grammar engine (xgrammar) reads past without holding the
output to them: a schema that uses one is refused before its job is queued, naming the keyword
and where it is, since the output could break it (the rest of JSON Schema is xgrammar's to
take or refuse, in the worker).

Measured with xgrammar 0.2.9 (a text breaking the keyword is taken): `uniqueItems`, `not`,
`if`/`then`/`else`, `dependentRequired`, `dependentSchemas` (and draft 7's `dependencies`),
`contains` (with `minContains`/`maxContains`), `allOf` of more than one schema (the
`required` of its branches is lost), and a `multipleOf` that is not a whole number.
"""

from __future__ import annotations

from typing import Any

UNENFORCED = ("uniqueItems", "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
              "contains", "minContains", "maxContains")
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
    if multiple is not None and not (isinstance(multiple, int) or float(multiple).is_integer()):
        raise ValueError(f"{where}: multipleOf {multiple} is not supported (only whole numbers)")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise ValueError(f"{where}: allOf of more than one schema is not supported (merge them into one)")
    for key in _SCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items() if isinstance(schema.get(key), dict) else ():
            check_enforceable(sub, f"{where}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []) if isinstance(schema.get(key), list) else ():
            check_enforceable(sub, f"{where}/{key}/{i}")
    for key in _SCHEMAS:
        sub = schema.get(key)
        if isinstance(sub, list):  # (draft 4's tuple items)
            for i, item in enumerate(sub):
                check_enforceable(item, f"{where}/{key}/{i}")
        else:
            check_enforceable(sub, f"{where}/{key}")
