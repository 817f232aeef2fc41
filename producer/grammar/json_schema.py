"""The JSON Schema subset guided decoding enforces, compiled to a graph of plain nodes.

`SamplingParams` compiles a `guided_decoding` `json_schema` to refuse what is outside the
subset before a job is queued (the API answers 400 naming the keyword); the worker compiles it
again to decode (`worker.guided.structured_output`). Plain Python, no dependencies.

Supported: `type` (one or a list), `properties` with `required` (keys in the order the schema
declares them; a property not required may be left out; no others: as OpenAI's strict mode),
`items`, `minItems`, `maxItems`, `enum`, `const`, `anyOf` (objects whose first property is a
different string `const` in each, as tool calls and tagged unions are, are followed as one
object until the tag is written, beside alternatives such as null that begin otherwise; other
alternatives that begin alike are followed together
until the text rules all but one out, at most 16 at once), `oneOf` whose alternatives begin
with different
characters (an object and a string, say), local `$ref` into `$defs` /
`definitions` (recursion included), and an object without `properties` or an absent schema
as any JSON value. Strings take one of `pattern` (producer.grammar.regex's syntax, found anywhere in
the string unless anchored), `format` (date, time, date-time, email, uuid, ipv4) or
`minLength`/`maxLength`; such a string is written without escapes. Integers take `minimum`,
`maximum` and their exclusive forms (a regex of the canonical decimals in range), and so do
numbers when the bounds are whole numbers (written then as plain decimals, no exponent).
Annotations (`title`, `description`, `default`, ...) are ignored. Anything else that
constrains a value (a fractional bound on a number, `multipleOf`, `prefixItems`, ...) is
refused: the output would not be guaranteed to satisfy it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from producer.grammar.json_values import (
    BOUND_KEYWORDS,
    STRING_KEYWORDS,
    integer_pattern,
    number_pattern,
    string_pattern,
)

ANNOTATIONS = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "$defs", "definitions", "strict",
}
KEYWORDS = {
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
} | STRING_KEYWORDS | BOUND_KEYWORDS
MAX_DEPTH = 64  # schemas nest at most this deep (the compiler recurses once per level)
_NUMBER_STARTS = frozenset("-0123456789")
_VALUE_STARTS = frozenset('{["tfn') | _NUMBER_STARTS


@dataclass(frozen=True)
class Node:
    """One schema position. kind: object | array | string | number | integer | literals |
    union | any (any JSON value) | any_object (any JSON object)."""

    kind: str
    properties: tuple[tuple[str, int], ...] = ()  # object: (key, node id), in schema order
    required: frozenset[str] = frozenset()
    item: int | None = None  # array: node id of its items
    min_items: int = 0
    max_items: int | None = None
    literals: tuple[str, ...] = ()  # literals: each allowed value as JSON text
    pattern: str | None = None  # string: a regex its whole text matches (written without escapes)
    alternatives: tuple[int, ...] = ()  # union: node ids, told apart by their first character


@dataclass
class SchemaGraph:
    nodes: list[Node] = field(default_factory=list)
    root: int = 0

    def first_chars(self, node_id: int, seen: frozenset[int] = frozenset()) -> frozenset[str]:
        """The characters a value of this node may begin with."""
        node = self.nodes[node_id]
        if node.kind == "union":
            inner = [self.first_chars(a, seen | {node_id}) for a in node.alternatives if a not in seen]
            return frozenset().union(*inner)
        return {
            "object": frozenset("{"), "any_object": frozenset("{"), "array": frozenset("["),
            "string": frozenset('"'),
            "number": _NUMBER_STARTS, "integer": _NUMBER_STARTS, "any": _VALUE_STARTS,
            "literals": frozenset(t[0] for t in node.literals),
        }[node.kind]


def compile_schema(schema: Any) -> SchemaGraph:
    """ValueError naming the place in the schema (a JSON pointer) and what is not supported."""
    compiler = _Compiler(schema)
    graph = compiler.graph
    graph.root = compiler.node(schema, "#")
    if not graph.first_chars(graph.root) <= frozenset("{["):
        raise ValueError("json_schema: the root must be an object or an array")
    return graph


class _Compiler:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.graph = SchemaGraph()
        self.refs: dict[str, int] = {}  # $ref -> node id, so recursive schemas terminate

    def node(self, schema: Any, where: str) -> int:
        if where.count("/") > MAX_DEPTH:
            raise ValueError(f"json_schema: {where[:80]}...: nested deeper than {MAX_DEPTH} levels")
        if schema is True or schema == {}:
            return self._add(Node("any"))
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema: {where} must be an object, got {schema!r}")
        unknown = sorted(set(schema) - KEYWORDS - ANNOTATIONS)
        if unknown:
            raise ValueError(f"json_schema: {where}: {', '.join(unknown)} not supported")
        if "$ref" in schema:
            return self._ref(schema["$ref"], where)
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise ValueError(f"json_schema: {where}: allOf with more than one schema not supported")
            return self.node(parts[0], f"{where}/allOf/0")
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self._union(schema[key], f"{where}/{key}", distinct=key == "oneOf")
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError(f"json_schema: {where}: enum must be a non-empty list")
            return self._add(Node("literals", literals=tuple(json.dumps(v, ensure_ascii=False) for v in values)))
        kinds = schema.get("type")
        if isinstance(kinds, list):
            alternatives = [{**schema, "type": kind} for kind in kinds]
            return self._union(alternatives, f"{where}/type", distinct=True)
        return self._typed(schema, kinds, where)

    def _typed(self, schema: dict[str, Any], kind: Any, where: str) -> int:
        if kind is None:
            if STRING_KEYWORDS & set(schema):
                raise ValueError(f"json_schema: {where}: {', '.join(sorted(STRING_KEYWORDS & set(schema)))} "
                                 'not supported without "type": "string"')
            if BOUND_KEYWORDS & set(schema):
                raise ValueError(f"json_schema: {where}: {', '.join(sorted(BOUND_KEYWORDS & set(schema)))} "
                                 'not supported without "type": "integer"')
            return self._add(Node("any"))
        if kind == "object":
            return self._object(schema, where)
        if kind == "array":
            return self._array(schema, where)
        if kind == "string":
            return self._add(Node(kind, pattern=string_pattern(schema, where)))
        if kind == "integer":
            return self._add(Node(kind, pattern=integer_pattern(schema, where)))
        if kind == "number":
            return self._add(Node(kind, pattern=number_pattern(schema, where)))
        if kind == "boolean":
            return self._add(Node("literals", literals=("true", "false")))
        if kind == "null":
            return self._add(Node("literals", literals=("null",)))
        raise ValueError(f"json_schema: {where}: unknown type {kind!r}")

    def _object(self, schema: dict[str, Any], where: str) -> int:
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        if extra not in (None, True, False, {}):
            raise ValueError(f"json_schema: {where}: additionalProperties with a schema not supported")
        if not properties:  # {} only when closed on purpose; else any object
            closed = "properties" in schema and extra is False
            return self._add(Node("object" if closed else "any_object"))
        if extra not in (None, False):
            raise ValueError(f"json_schema: {where}: additionalProperties beside properties not supported")
        for key in properties:
            if not key or any(c in key for c in '"\\') or any(ord(c) < 0x20 for c in key):
                raise ValueError(f"json_schema: {where}: property name {key!r} not supported")
        required = frozenset(schema.get("required", ()))
        missing = sorted(required - set(properties))
        if missing:
            raise ValueError(f"json_schema: {where}: required names unknown properties {missing}")
        node_id = self._add(Node("object"))  # placeholder first: children may refer back
        children = tuple((key, self.node(sub, f"{where}/properties/{key}")) for key, sub in properties.items())
        self.graph.nodes[node_id] = Node("object", properties=children, required=required)
        return node_id

    def _array(self, schema: dict[str, Any], where: str) -> int:
        min_items, max_items = schema.get("minItems", 0), schema.get("maxItems")
        if not isinstance(min_items, int) or min_items < 0 or (max_items is not None and (
                not isinstance(max_items, int) or max_items < min_items)):
            raise ValueError(f"json_schema: {where}: minItems/maxItems must be integers, 0 <= min <= max")
        node_id = self._add(Node("array"))
        item = self.node(schema.get("items", True), f"{where}/items")
        self.graph.nodes[node_id] = Node("array", item=item, min_items=min_items, max_items=max_items)
        return node_id

    def _union(self, alternatives: Any, where: str, distinct: bool) -> int:
        """`distinct`: the alternatives must begin with different characters (oneOf, where a
        value that fits two would fit none; a list of types, which never overlap but for
        integer and number)."""
        if not isinstance(alternatives, list) or not alternatives:
            raise ValueError(f"json_schema: {where} must be a non-empty list")
        ids = [self.node(sub, f"{where}/{i}") for i, sub in enumerate(alternatives)]
        if len(ids) == 1:
            return ids[0]
        seen: set[str] = set()
        for i in ids if distinct else ():
            starts = self.graph.first_chars(i)
            if seen & starts:
                raise ValueError(
                    f"json_schema: {where}: alternatives that can begin with the same character "
                    f"({''.join(sorted(seen & starts))}) not supported"
                )
            seen |= starts
        return self._add(Node("union", alternatives=tuple(ids)))

    def _ref(self, ref: Any, where: str) -> int:
        if ref in self.refs:
            return self.refs[ref]
        parts = ref.split("/") if isinstance(ref, str) else []
        if len(parts) != 3 or parts[0] != "#" or parts[1] not in ("$defs", "definitions"):
            raise ValueError(f"json_schema: {where}: only local $ref '#/$defs/<name>' is supported, got {ref!r}")
        target = self.root.get(parts[1], {}).get(parts[2]) if isinstance(self.root, dict) else None
        if target is None:
            raise ValueError(f"json_schema: {where}: $ref {ref!r} names nothing")
        # A forward node that the target's node replaces: a recursive reference finds it.
        placeholder = self._add(Node("union"))
        self.refs[ref] = placeholder
        resolved = self.node(target, ref)
        self.graph.nodes[placeholder] = Node("union", alternatives=(resolved,))
        return placeholder

    def _add(self, node: Node) -> int:
        self.graph.nodes.append(node)
        return len(self.graph.nodes) - 1
