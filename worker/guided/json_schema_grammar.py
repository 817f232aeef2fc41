"""The JSON-schema grammar for guided decoding (`json_schema`, the subset `producer.grammar.json_schema`
compiles): objects with properties, arrays, numbers, literals and unions step here; strings
and free-form values run the generic JSON automaton of `worker.guided.json_grammar` inside their
frame, and strings or numbers under a pattern, format or bounds run their regex
(`producer.grammar.json_values`). States are hashable and read UTF-8 one byte per character.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from dataclasses import replace
from typing import Any

from producer.grammar.json_schema import Node, compile_schema
from producer.grammar.regex import compile_regex
from worker.guided.json_grammar import (
    DIGITS,
    MAX_WHITESPACE_RUN,
    NUMBER_ENDS,
    SPACE_DUE,
    STRING_STOPS,
    WHITESPACE,
    JsonState,
    compact_json_step,
    json_step,
    number_next,
)
from worker.guided.token_bytes import byte_text

Frame = tuple[int, str, Any]
SchemaState = tuple[tuple[Frame, ...], int]  # (frames, whitespace run); no frames: done
# While alternatives of an `anyOf` that begin alike are all still possible, the grammar's state
# is the frozenset of their SchemaStates, stepped together; a step returns a list of them.
Step = SchemaState | list[SchemaState] | None
MAX_ALTERNATIVES = 16  # live at once; past it the text is refused (no schema-driven blow-up)
_WHITESPACE_PHASES = {"start", "open", "colon", "after", "comma", "next"}
_GENERIC_VALUE: JsonState = ((), "value", None, 0)  # where an embedded any-value starts
_AFTER_SEPARATOR = {"comma", "next", "start"}  # phases a `,` or `:` leads to: compact JSON's space comes next


class JsonSchemaGrammar:
    """Values of a compiled schema. Structured parts (objects with properties, arrays,
    numbers, literals, unions) step here; strings and free-form values run the generic JSON
    automaton inside their frame."""

    def __init__(self, schema: dict[str, Any], compact: bool = False) -> None:
        """`compact` (vLLM's disable_any_whitespace): no whitespace but the one space after
        each `,` and `:`, as xgrammar writes JSON then."""
        self.graph = compile_schema(schema)
        self.graph.nodes = [_in_bytes(node) for node in self.graph.nodes]
        self.nodes = self.graph.nodes
        self.compact = compact
        self._json_step = compact_json_step if compact else json_step
        self.key: Hashable = ("json_schema", json.dumps(schema, sort_keys=True), compact)
        self._keys_at: dict[tuple[int, int], tuple[tuple[str, int], ...]] = {}
        # tagged unions: union node -> the object every alternative begins as (its tag
        # property only), and the tag object's node -> {tag literal: alternative}
        self._tagged: dict[int, int] = {}
        self._tags: dict[int, dict[str, int]] = {}
        for node_id in range(len(self.nodes)):
            self._add_tagged(node_id)
        self._first_chars = [self.graph.first_chars(i) for i in range(len(self.nodes))]
        # strings under a pattern, format or length: their text's automaton, by node
        self._patterns = {i: compile_regex(n.pattern) for i, n in enumerate(self.nodes) if n.pattern is not None}

    def _add_tagged(self, node_id: int) -> None:
        """A union whose objects all begin with the same required property, each a different
        string constant (`{"name": "f", ...}`, as tool calls and discriminated unions are;
        its other alternatives, such as null, begin otherwise) is followed as one object until
        the tag is written, then as the alternative it names: one state where following each
        would take one per alternative."""
        node = self.nodes[node_id]
        if node.kind != "union":
            return
        objects = [a for a in node.alternatives if self.nodes[a].kind == "object"]
        others = [a for a in node.alternatives if a not in objects]  # null, say: not beginning with {
        if len(objects) < 2 or any("{" in self.graph.first_chars(a) for a in others):
            return
        alternatives = [self.nodes[a] for a in objects]
        if not all(a.properties and a.properties[0][0] in a.required for a in alternatives):
            return
        key = alternatives[0].properties[0][0]
        tags = [self.nodes[a.properties[0][1]] for a in alternatives]
        if any(a.properties[0][0] != key for a in alternatives) or not all(
            t.kind == "literals" and len(t.literals) == 1 for t in tags
        ):
            return
        literals = [t.literals[0] for t in tags]
        if len(set(literals)) != len(literals) or not all(lit.startswith('"') for lit in literals):
            return  # strings only: a complete tag is never the start of another
        self.nodes.append(Node("literals", literals=tuple(literals)))
        tag_object = Node("object", properties=((key, len(self.nodes) - 1),), required=frozenset({key}))
        self.nodes.append(tag_object)
        self._tagged[node_id] = len(self.nodes) - 1
        self._tags[len(self.nodes) - 1] = dict(zip(literals, objects, strict=True))

    def initial(self) -> Hashable:
        return (((self.graph.root, "start", None),), 0)

    def is_complete(self, state: Hashable) -> bool:
        if isinstance(state, frozenset):
            return any(s[0] == () for s in state)
        return state[0] == ()  # type: ignore[index]

    def advance(self, state: Hashable, text: str) -> Hashable | None:
        if state.__class__ is frozenset:
            return self._advance_all(list(state), text)  # type: ignore[arg-type]
        frames = state[0]  # type: ignore[index]
        if frames and frames[-1][1] == "any" and frames[-1][2][1] == "string" and not STRING_STOPS.search(text):
            return state  # plain text inside a string (see JsonObjectGrammar.advance)
        current: Step = state  # type: ignore[assignment]
        for char in text:
            current = self._step(current, char)  # type: ignore[arg-type]
            if current.__class__ is not tuple:
                break
        if current.__class__ is list:  # alternatives that began alike: the slow way, again
            return self._advance_all([state], text)  # type: ignore[list-item]
        return current  # type: ignore[return-value]

    def _advance_all(self, states: list[SchemaState], text: str) -> Hashable | None:
        """Step every live alternative; the ones that cannot take a character drop out."""
        for char in text:
            stepped: list[SchemaState] = []
            for state in states:
                step = self._step(state, char)
                if isinstance(step, list):
                    stepped += step
                elif step is not None:
                    stepped.append(step)
            states = list(dict.fromkeys(stepped))
            if not states or len(states) > MAX_ALTERNATIVES:
                return None
        if not states or len(states) > MAX_ALTERNATIVES:
            return None
        return states[0] if len(states) == 1 else frozenset(states)

    def _step(self, state: SchemaState, char: str) -> Step:
        frames, ws = state
        if not frames:
            return None  # the value is complete: nothing may follow
        if self.compact:
            return self._compact_step(state, char)
        if frames[-1][1] in _WHITESPACE_PHASES and char in WHITESPACE:
            return (frames, ws + 1) if ws < MAX_WHITESPACE_RUN else None
        return self._step_value(frames, char)

    def _compact_step(self, state: SchemaState, char: str) -> Step:
        """Whitespace only as the one space after a separator (the state's count is
        SPACE_DUE until it comes): elsewhere between values no step takes it, and inside
        strings and free-form values the compact generic automaton rules."""
        frames, ws = state
        if ws == SPACE_DUE:
            return (frames, 0) if char == " " else None
        stepped = self._step_value(frames, char)
        if char in ",:" and isinstance(stepped, tuple) and stepped[0] and stepped[0][-1][1] in _AFTER_SEPARATOR:
            return (stepped[0], SPACE_DUE)
        if isinstance(stepped, list):
            return [(f, SPACE_DUE) if char in ",:" and f and f[-1][1] in _AFTER_SEPARATOR else (f, w)
                    for f, w in stepped]
        return stepped

    def _step_value(self, frames: tuple[Frame, ...], char: str) -> Step:
        node_id, phase, aux = frames[-1]
        rest = frames[:-1]
        if phase == "start":
            return self._begin(rest, node_id, char)
        node = self.nodes[node_id]
        if node.kind == "object":
            return self._object(rest, node_id, node, phase, aux, char)
        if node.kind == "array":
            return self._array(rest, node_id, node, phase, aux, char)
        if node.kind == "literals":
            return self._literal(rest, node_id, node, aux, char)
        if phase == "pattern":
            return self._pattern_char(rest, node_id, aux, char)
        if phase == "bounded":
            return self._bounded_char(rest, node_id, aux, char)
        if node.kind in ("number", "integer"):
            nxt = number_next(aux, char, node.kind == "integer")
            if nxt is not None:
                return ((*rest, (node_id, phase, nxt)), 0)
            return self._step((rest, 0), char) if aux in NUMBER_ENDS else None
        return self._generic(rest, node_id, aux, char)  # string, any, any_object

    def _begin(self, rest: tuple[Frame, ...], node_id: int, char: str) -> Step:
        """A value of node `node_id` starting with `char`."""
        node = self.nodes[node_id]
        kind = node.kind
        if char == "{" and node_id in self._tagged:
            return ((*rest, (self._tagged[node_id], "open", 0)), 0)
        if kind == "union":
            begun: list[SchemaState] = []
            for alternative in node.alternatives:
                if char in self._first_chars[alternative]:
                    step = self._begin(rest, alternative, char)
                    if isinstance(step, list):
                        begun += step
                    elif step is not None:
                        begun.append(step)
            return None if not begun else begun[0] if len(begun) == 1 else begun
        if kind in ("object", "array"):
            opened = char == ("{" if kind == "object" else "[")
            return ((*rest, (node_id, "open", 0)), 0) if opened else None
        if kind == "literals":
            return self._literal(rest, node_id, node, "", char)
        if node_id in self._patterns and kind in ("integer", "number"):  # within bounds: its text's automaton
            return self._bounded_char(rest, node_id, self._patterns[node_id].initial, char)
        if kind in ("number", "integer"):
            part = "sign" if char == "-" else "zero" if char == "0" else "int" if char in DIGITS else None
            return None if part is None else ((*rest, (node_id, "num", part)), 0)
        if (kind == "string" and char != '"') or (kind == "any_object" and char != "{"):
            return None
        if node_id in self._patterns:
            return ((*rest, (node_id, "pattern", self._patterns[node_id].initial)), 0)
        return self._generic(rest, node_id, _GENERIC_VALUE, char)

    def _generic(self, rest: tuple[Frame, ...], node_id: int, inner: JsonState, char: str) -> Step:
        """A string or free-form value: the generic automaton, from an empty stack. It ends
        when that stack closes again (a number: at the first character it cannot take)."""
        stack, mode, part, _ = inner
        if not stack and mode == "number":
            nxt = number_next(part, char)
            if nxt is not None:
                return ((*rest, (node_id, "any", (stack, mode, nxt, 0))), 0)
            return self._step((rest, 0), char) if part in NUMBER_ENDS else None
        new = self._json_step(inner, char)
        if new is None:
            return None
        if not new[0] and new[1] in ("after_value", "done"):
            return (rest, 0)  # the value closed with this character
        return ((*rest, (node_id, "any", new)), 0)

    def _pattern_char(self, rest: tuple[Frame, ...], node_id: int, state: frozenset[int], char: str) -> Step:
        """Inside a string whose text must match a pattern: the closing quote where the
        pattern is matched, else a character it can take; never an escape or a control
        character (the text is written as it is)."""
        regex = self._patterns[node_id]
        if char == '"':
            return (rest, 0) if regex.accepts(state) else None
        if char == "\\" or ord(char) < 0x20:
            return None
        nxt = regex.step(state, ord(char))
        return None if nxt is None else ((*rest, (node_id, "pattern", nxt)), 0)

    def _bounded_char(self, rest: tuple[Frame, ...], node_id: int, state: frozenset[int], char: str) -> Step:
        """A number within bounds: a character its text can take; else, once the text is a
        whole number in bounds, the character belongs to what follows it."""
        regex = self._patterns[node_id]
        nxt = regex.step(state, ord(char))
        if nxt is not None:
            return ((*rest, (node_id, "bounded", nxt)), 0)
        if state is not regex.initial and regex.accepts(state):
            return self._step((rest, 0), char)
        return None

    def _literal(self, rest: tuple[Frame, ...], node_id: int, node: Node, text: str, char: str) -> Step:
        longer = text + char
        if any(lit.startswith(longer) for lit in node.literals):
            if longer in node.literals and not any(len(lit) > len(longer) and lit.startswith(longer) for lit in node.literals):
                return self._done_literal(rest, longer)  # nothing can extend it: complete now
            return ((*rest, (node_id, "lit", longer)), 0)
        # a complete literal that another could have extended (1 of [1, 12]) ends here
        return self._step((rest, 0), char) if text in node.literals else None

    def _done_literal(self, rest: tuple[Frame, ...], literal: str) -> SchemaState:
        """A literal is complete. If it was a tagged union's tag, the object goes on as the
        alternative the tag names, after its first property."""
        if rest and rest[-1][0] in self._tags:
            alternative = self._tags[rest[-1][0]][literal]
            return ((*rest[:-1], (alternative, "after", 1)), 0)
        return (rest, 0)

    def _object(self, rest: tuple[Frame, ...], node_id: int, node: Node, phase: str, aux: Any, char: str) -> Step:
        if phase in ("open", "after"):  # aux: index of the next property that may come
            if char == "}" and not any(k in node.required for k, _ in node.properties[aux:]):
                return (rest, 0)
            if phase == "open" and char == '"' and self.keys_at(node_id, aux):
                return ((*rest, (node_id, "key", (aux, ""))), 0)
            if phase == "after" and char == "," and self.keys_at(node_id, aux):
                return ((*rest, (node_id, "comma", aux)), 0)
            return None
        if phase == "comma":
            return ((*rest, (node_id, "key", (aux, ""))), 0) if char == '"' else None
        if phase == "key":
            position, text = aux
            keys = self.keys_at(node_id, position)
            if char == '"':
                index = next((j for key, j in keys if key == text), None)
                return None if index is None else ((*rest, (node_id, "colon", index)), 0)
            if any(key.startswith(text + char) for key, _ in keys):
                return ((*rest, (node_id, "key", (position, text + char))), 0)
            return None
        # phase "colon", aux: index of the property whose value follows
        if char != ":":
            return None
        child = node.properties[aux][1]
        return ((*rest, (node_id, "after", aux + 1), (child, "start", None)), 0)

    def keys_at(self, node_id: int, position: int) -> tuple[tuple[str, int], ...]:
        """(key, index) of the properties that may come next: in schema order, skipping only
        properties that are not required."""
        cached = self._keys_at.get((node_id, position))
        if cached is None:
            node, keys = self.nodes[node_id], []
            for j in range(position, len(node.properties)):
                keys.append((node.properties[j][0], j))
                if node.properties[j][0] in node.required:
                    break
            cached = self._keys_at[(node_id, position)] = tuple(keys)
        return cached

    def _array(self, rest: tuple[Frame, ...], node_id: int, node: Node, phase: str, count: int, char: str) -> Step:
        """count: items so far, capped where the limits stop telling counts apart."""
        if char == "]" and phase in ("open", "after") and count >= node.min_items:
            return (rest, 0)
        if phase == "after":
            more = node.max_items is None or count < node.max_items
            return ((*rest, (node_id, "next", count)), 0) if char == "," and more else None
        if phase == "open" and node.max_items == 0:
            return None
        cap = node.max_items if node.max_items is not None else node.min_items
        assert node.item is not None
        return self._begin((*rest, (node_id, "after", min(count + 1, cap))), node.item, char)


def _in_bytes(node: Node) -> Node:
    """A node's literals and property names as the grammar reads them: UTF-8, a byte per
    character."""
    if not node.literals and not node.properties:
        return node

    def as_read(text: str) -> str:
        return byte_text(text.encode())

    return replace(
        node, literals=tuple(as_read(lit) for lit in node.literals),
        properties=tuple((as_read(key), j) for key, j in node.properties),
        required=frozenset(as_read(key) for key in node.required),
    )
