"""The structural-tag grammar (`producer.grammar.structural_tag` says what it is): free text, and
after a trigger one of the structures it begins, each a begin text, a JSON value of its
schema (`worker.guided.json_schema_grammar`) and an end text.

A state is one of
  ("free", tail)            tail: the output's end, as far as it may begin a trigger
  ("begin", typed)          a begin text being written (it starts with a trigger)
  ("value", i, json_state)  structure i's value
  ("end", i, typed)         structure i's end text being written
read one byte-character at a time (`worker.guided.structured_output.Grammar`); free text with no
character that begins a trigger is taken whole.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from typing import Any

from producer.grammar.structural_tag import read_structural_tag
from worker.guided.json_grammar import WHITESPACE
from worker.guided.json_schema_grammar import JsonSchemaGrammar
from worker.guided.token_bytes import byte_text

State = tuple[Any, ...]


class StructuralTagGrammar:
    # special tokens are taken by their text (a trigger may be one); in free text any may come,
    # as unguided
    reads_special_tokens = True

    def __init__(self, spec: dict[str, Any]) -> None:
        """`spec`: as the request gave it (SamplingParams checked it)."""
        spec = read_structural_tag(spec)
        self.triggers = tuple(byte_text(t.encode()) for t in spec["triggers"])
        self.begins = tuple(byte_text(s["begin"].encode()) for s in spec["structures"])
        self.ends = tuple(byte_text(s["end"].encode()) for s in spec["structures"])
        self.values = tuple(JsonSchemaGrammar(s["schema"]) for s in spec["structures"])
        self.starts = frozenset(t[0] for t in self.triggers)
        self.key: Hashable = ("structural_tag", json.dumps(spec, sort_keys=True))

    def initial(self) -> Hashable:
        return ("free", "")

    def is_complete(self, state: Hashable) -> bool:
        current: State = state  # type: ignore[assignment]
        if current[0] == "value":  # a value may end the output where its structure has no end text
            return not self.ends[current[1]] and self.values[current[1]].is_complete(current[2])
        return current[0] == "free"

    def advance(self, state: Hashable, text: str) -> Hashable | None:
        current: State | None = state  # type: ignore[assignment]
        if current == ("free", "") and self.starts.isdisjoint(text):
            return current  # prose that cannot begin a trigger
        for char in text:
            current = self._step(current, char)  # type: ignore[arg-type]
            if current is None:
                return None
        return current

    def _step(self, state: State, char: str) -> State | None:
        mode = state[0]
        if mode == "free":
            return self._free(state[1] + char)
        if mode == "begin":
            return self._begin(state[1] + char)
        if mode == "value":
            _, i, value = state
            if char in WHITESPACE and value == self.values[i].initial():
                return None  # the value follows its begin text at once, as xgrammar has it
            nxt = self.values[i].advance(value, char)
            if nxt is not None:
                return ("value", i, nxt)
            return self._end(i, char) if self.values[i].is_complete(value) else None
        return self._end(state[1], state[2] + char)

    def _free(self, seen: str) -> State | None:
        """Free text ending in `seen`: a trigger written whole opens its structures, else the
        longest end of `seen` that may still begin one is kept."""
        for trigger in self.triggers:
            if seen.endswith(trigger):
                return self._begin(trigger)
        for start in range(len(seen)):
            tail = seen[start:]
            if any(t.startswith(tail) for t in self.triggers):
                return ("free", tail)
        return ("free", "")

    def _begin(self, typed: str) -> State | None:
        for i, begin in enumerate(self.begins):
            if begin == typed:
                return ("value", i, self.values[i].initial())
        return ("begin", typed) if any(b.startswith(typed) for b in self.begins) else None

    def _end(self, i: int, typed: str) -> State | None:
        end = self.ends[i]
        if typed == end:
            return ("free", "")
        if end.startswith(typed):
            return ("end", i, typed)
        if not end:  # no end text: the character is the free text's first
            return self._free(typed)
        return None
