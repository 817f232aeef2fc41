"""The JSON Schema subset guided decoding enforces, compiled to a graph of plain nodes.

`SamplingParams` compiles a `guided_decoding` `json_schema` to refuse what is outside the
subset before a job is queued (the API answers 400 naming the keyword); the worker compiles it
again to decode (`worker.structured_output`). Plain Python, no dependencies.

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
as any JSON value. Strings take one of `pattern` (producer.regex's syntax, found anywhere in
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
import math
from dataclasses import dataclass, field
from typing import Any

from producer.regex import RegexError, compile_regex

ANNOTATIONS = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "$defs", "definitions", "strict",
}
STRING_KEYWORDS = {"pattern", "format", "minLength", "maxLength"}
BOUND_KEYWORDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
KEYWORDS = {
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
} | STRING_KEYWORDS | BOUND_KEYWORDS
# A character of a string the grammar writes: anything JSON needs no escape for. Strings
# under a pattern are written without escapes, so their text is their value.
PLAIN_CHAR = r'[^"\\\x00-\x1f]'
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,9})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
FORMATS = {  # JSON Schema formats, as regular expressions over the string's text
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "email": r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(\.[A-Za-z0-9-]{1,63})*\.[A-Za-z]{2,24}",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": rf"({_OCTET}\.){{3}}{_OCTET}",
}
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


def string_pattern(schema: dict[str, Any], where: str) -> str | None:
    """The regex a string's whole text must match, from `pattern` (matched anywhere in the
    string unless anchored, as JSON Schema means it), `format`, or `minLength`/`maxLength`
    (in characters); None when the string is free."""
    given = sorted(STRING_KEYWORDS & set(schema))
    if not given:
        return None
    if len(set(given) & {"pattern", "format"}) > 1 or (
            set(given) & {"pattern", "format"} and set(given) & {"minLength", "maxLength"}):
        raise ValueError(f"json_schema: {where}: {' beside '.join(given)} not supported: one of pattern, format, "
                         "or minLength/maxLength")
    if "pattern" in schema:
        content = _search(schema["pattern"], where)
    elif "format" in schema:
        if schema["format"] not in FORMATS:
            raise ValueError(f"json_schema: {where}: format {schema['format']!r} not supported "
                             f"(supported: {', '.join(FORMATS)})")
        content = FORMATS[schema["format"]]
    else:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not isinstance(low, int) or low < 0 or (high is not None and (not isinstance(high, int) or high < low)):
            raise ValueError(f"json_schema: {where}: minLength/maxLength must be integers, 0 <= min <= max")
        content = f"{PLAIN_CHAR}{{{low},{'' if high is None else high}}}"
    try:
        compile_regex(content)
    except RegexError as exc:
        raise ValueError(f"json_schema: {where}: {str(exc).removeprefix('regex ')}") from None
    return content


def _bounds(schema: dict[str, Any], where: str) -> list[tuple[str, float]]:
    """(keyword, bound) for each of minimum, maximum and their exclusive forms present."""
    out: list[tuple[str, float]] = []
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        if key in schema:
            bound = schema[key]
            if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound):
                raise ValueError(f"json_schema: {where}: {key} must be a number, got {bound!r}")
            out.append((key, bound))
    return out


def integer_pattern(schema: dict[str, Any], where: str) -> str | None:
    """The regex of an integer's decimal text within its bounds (minimum, maximum and their
    exclusive forms); None when it has none."""
    bounds = _bounds(schema, where)
    if not bounds:
        return None
    lows: list[int] = []
    highs: list[int] = []
    for key, bound in bounds:
        # the integers within a bound: ceil of a lower one, floor of an upper one
        lower = key.endswith("inimum")
        whole = -math.floor(-bound) if lower else math.floor(bound)
        if whole == bound and key.startswith("exclusive"):
            whole += 1 if lower else -1
        (lows if lower else highs).append(int(whole))
    low, high = max(lows) if lows else None, min(highs) if highs else None
    if low is not None and high is not None and low > high:
        raise ValueError(f"json_schema: {where}: no integer lies within the bounds")
    return integer_range_regex(low, high)


def number_pattern(schema: dict[str, Any], where: str) -> str | None:
    """The regex of a number's text (plain decimals, no exponent) within whole-number bounds;
    None without bounds."""
    bounds = _bounds(schema, where)
    if not bounds:
        return None
    low: tuple[int, bool] | None = None  # (bound, exclusive); the tighter wins
    high: tuple[int, bool] | None = None
    for key, bound in bounds:
        if bound != int(bound):
            raise ValueError(f"json_schema: {where}: {key} {bound!r} not supported on a number: "
                             "only whole-number bounds")
        edge = (int(bound), key.startswith("exclusive"))
        if key.endswith("inimum"):
            low = edge if low is None or (edge[0], edge[1]) > low else low
        else:
            high = edge if high is None or (edge[0], not edge[1]) < (high[0], not high[1]) else high
    if low is not None and high is not None and (low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1]))):
        raise ValueError(f"json_schema: {where}: no number lies within the bounds")
    parts = []
    if low is None or low[0] < 0:  # v < 0 is -x: x in (max(-high, 0), -low), ends swapped
        x_low = (-high[0], high[1]) if high is not None and high[0] < 0 else (0, True)
        x_high = None if low is None else (-low[0], low[1])
        parts += [f"-(?:{m})" for m in _magnitudes(x_low, x_high)]
    if high is None or high[0] > 0 or (high[0] == 0 and not high[1]):
        parts += _magnitudes(low if low is not None and low[0] >= 0 else (0, False), high)
    return "|".join(parts)


_FRACTION, _NONZERO_FRACTION, _ZERO_FRACTION = r"(\.\d+)?", r"\.\d*[1-9]\d*", r"(\.0+)?"


def _magnitudes(low: tuple[int, bool], high: tuple[int, bool] | None) -> list[str]:
    """Alternatives for the decimals x >= 0 within (low, high), each end (bound, exclusive):
    whole parts strictly inside take any fraction; the ends take what keeps x within."""
    (a, a_open), b = low, high
    out = []
    inner_high = None if b is None else b[0] - 1
    if inner_high is None or a + 1 <= inner_high:
        out.append(f"(?:{integer_range_regex(a + 1, inner_high)}){_FRACTION}")
    if b is not None and b[0] == a:
        return out + ([] if a_open or b[1] else [f"{a}{_ZERO_FRACTION}"])
    out.append(f"{a}{_NONZERO_FRACTION if a_open else _FRACTION}")
    if b is not None and not b[1]:
        out.append(f"{b[0]}{_ZERO_FRACTION}")
    return out


def integer_range_regex(low: int | None, high: int | None) -> str:
    """A regex matching exactly the canonical decimal texts (no leading zeros, no -0) of the
    integers in [low, high]; None: unbounded on that side."""
    parts = []
    if low is None or low < 0:  # the negatives, as - and their magnitudes
        magnitude_low = 1 if high is None or high >= 0 else -high
        magnitude_high = None if low is None else -low
        parts.append("-(?:" + "|".join(_naturals(magnitude_low, magnitude_high)) + ")")
    if high is None or high >= 0:
        parts += _naturals(0 if low is None or low < 0 else low, high)
    return "|".join(parts)


def _naturals(low: int, high: int | None) -> list[str]:
    """Alternatives for the integers in [low, high] (>= 0; high None: no end), by digit count."""
    out: list[str] = []
    n = len(str(low))
    while True:
        first = low if n == len(str(low)) else 10 ** (n - 1)
        if high is not None and first > high:
            return out
        if high is None and first == 10 ** (n - 1) and n > 1:
            return [*out, rf"[1-9]\d{{{n - 1},}}"]  # every number of n digits or more
        out += _same_length(first, 10 ** n - 1 if high is None else min(high, 10 ** n - 1))
        n += 1
    return out


def _same_length(low: int, high: int) -> list[str]:
    """Alternatives for [low, high], both of the same digit count: runs of aligned blocks
    (fixed leading digits, then free ones), neighbours merged into a digit range."""
    if high < 10:
        return [str(low) if low == high else f"[{low}-{high}]"]
    blocks: list[tuple[str, int, int, int]] = []  # (fixed digits, first digit, last digit, free digits)
    start = low
    while start <= high:
        free = 0
        while start % 10 ** (free + 1) == 0 and start + 10 ** (free + 1) - 1 <= high:
            free += 1
        digits = str(start)
        fixed, digit = digits[: len(digits) - free - 1], int(digits[len(digits) - free - 1])
        if blocks and blocks[-1][0] == fixed and blocks[-1][3] == free and blocks[-1][2] == digit - 1:
            blocks[-1] = (fixed, blocks[-1][1], digit, free)
        else:
            blocks.append((fixed, digit, digit, free))
        start += 10 ** free
    return [fixed + (str(a) if a == b else f"[{a}-{b}]") + (rf"\d{{{free}}}" if free else "")
            for fixed, a, b, free in blocks]


def _search(pattern: Any, where: str) -> str:
    """A JSON Schema pattern (found anywhere in the string) as a whole-text regex."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"json_schema: {where}: pattern must be a non-empty string, got {pattern!r}")
    anchored_start = pattern.startswith("^")
    core = pattern[1:] if anchored_start else pattern
    escapes = len(core[:-1]) - len(core[:-1].rstrip("\\"))  # backslashes before a final $
    anchored_end = core.endswith("$") and escapes % 2 == 0
    if anchored_end:
        core = core[:-1]
    if core:
        try:
            compile_regex(core)  # its own errors, before it is wrapped
        except RegexError as exc:
            reason = str(exc).split(": ", 1)[-1]
            raise ValueError(f"json_schema: {where}: pattern {pattern!r}: {reason}") from None
    any_text = f"{PLAIN_CHAR}*"
    return f"{'' if anchored_start else any_text}(?:{core}){'' if anchored_end else any_text}"


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
