"""EBNF text read into the expression trees `producer.grammar.ebnf` compiles: rule name ->
(expression, where it is defined), with EbnfError naming the line and column of a mistake.
Its own module because two readers share it: `producer.grammar.lark` reads a Lark grammar
into the same trees by extending EbnfReader, and `producer.grammar.ebnf` picks one reader or
the other and compiles what it read (the syntax is described there).
"""

from __future__ import annotations

import re

from producer.grammar.regex import MAX_REPEAT, _complement, _normalize

ROOT = "root"

_SIMPLE_ESCAPES = {
    '"': '"', "\\": "\\", "/": "/", "'": "'", "?": "?", "n": "\n", "r": "\r", "t": "\t",
    "b": "\b", "f": "\f", "a": "\a", "v": "\v", "0": "\0", "e": "\x1b",
}
_CLASS_META = frozenset("^$\\.*+?()[]{}|/-")
_HEX = frozenset("0123456789abcdefABCDEF")
_NAME_START = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_NAME_CHARS = _NAME_START | set("0123456789-.")
_RULE_START = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*[ \t]*(\[[^\]\n]*\])?[ \t]*::=")


class EbnfError(ValueError):
    pass


# -- parsing ------------------------------------------------------------------------------------
# An expression is ("alt", [sequences]) | ("seq", [items]) | ("lit", text) | ("cls", ranges) |
# ("ref", name, offset) | ("rep", expr, min, max or None) | ("tok", expr) (producer.grammar.lark's)


class EbnfReader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0

    def parse(self) -> dict[str, tuple[object, int]]:
        """Rule name -> (its expression, where it is defined)."""
        rules: dict[str, tuple[object, int]] = {}
        self._skip()
        while self.i < len(self.text):
            at = self.i
            name = self._name()
            self._skip(newlines=False)
            if self._peek() == "[":
                raise self._error("rule options such as [temperature=...] are not supported")
            if not self.text.startswith("::=", self.i):
                raise self._error(f"expected '::=' after the rule name {name!r}")
            if name in rules:
                raise self._error(f"rule {name!r} is defined twice", at)
            self.i += 3
            rules[name] = (self._alternation(), at)
            self._skip()
        if not rules:
            raise EbnfError("grammar has no rules")
        return rules

    def root(self, rules: dict[str, tuple[object, int]]) -> str:
        """The rule the output begins at."""
        return ROOT

    def _error(self, what: str, at: int | None = None) -> EbnfError:
        at = self.i if at is None else at
        line = self.text.count("\n", 0, at) + 1
        column = at - (self.text.rfind("\n", 0, at) + 1) + 1
        return EbnfError(f"grammar line {line}, column {column}: {what}")

    def _peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def _skip(self, newlines: bool = True) -> None:
        """Past spaces and comments (and line breaks, unless not)."""
        while self.i < len(self.text):
            ch = self.text[self.i]
            if ch == "#":
                end = self.text.find("\n", self.i)
                self.i = len(self.text) if end < 0 else end
            elif ch in " \t\r" or (newlines and ch == "\n"):
                self.i += 1
            else:
                return

    def _name(self) -> str:
        start = self.i
        if self._peek() not in _NAME_START:
            raise self._error(f"expected a rule name, got {self._peek() or 'the end'!r}")
        while self._peek() in _NAME_CHARS and self._peek():
            self.i += 1
        return self.text[start : self.i]

    def _at_rule_start(self) -> bool:
        """A name followed by `::=` (or by rule options and `::=`) begins the next rule."""
        return _RULE_START.match(self.text, self.i) is not None

    def _alternation(self) -> object:
        branches = [self._sequence()]
        while self._peek() == "|":
            self.i += 1
            branches.append(self._sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def _sequence(self) -> object:
        items = []
        while True:
            self._skip()
            if self._peek() in ("", "|", ")") or self._at_rule_start():
                break
            items.append(self._quantified(self._atom()))
        return items[0] if len(items) == 1 else ("seq", items)

    def _atom(self) -> object:
        at, ch = self.i, self._peek()
        if ch == '"':
            self.i += 1
            return ("lit", self._literal())
        if ch == "[":
            self.i += 1
            return ("cls", self._class())
        if ch == "(":
            self.i += 1
            node = self._alternation()
            self._skip()
            if self._peek() != ")":
                raise self._error("missing ')'")
            self.i += 1
            return node
        if ch in _NAME_START:
            name = self._name()
            if self._peek() == "(":
                raise self._error(f"macros such as {name}(...) are not supported", at)
            return ("ref", name, at)
        if ch in "*+?{":
            raise self._error(f"nothing to repeat before {ch!r}")
        if ch == "'":
            raise self._error("string literals take double quotes")
        raise self._error(f"unexpected {ch!r}")

    def _literal(self) -> str:
        out: list[str] = []
        while True:
            ch = self._char('"')
            if ch is None:
                return "".join(out)
            out.append(ch)

    def _char(self, close: str, meta: frozenset[str] = frozenset()) -> str | None:
        """One character of a literal or class (escapes read), or None at `close`."""
        if self.i >= len(self.text):
            raise self._error(f"missing closing {close!r}")
        ch = self.text[self.i]
        self.i += 1
        if ch == close:
            return None
        if ch == "\n":
            raise self._error("a line break inside a literal or class: write \\n", self.i - 1)
        if ch != "\\":
            return ch
        esc = self.text[self.i : self.i + 1]
        self.i += 1
        if esc in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[esc]
        if esc in meta:
            return esc
        if esc in ("x", "u", "U"):
            start, limit = self.i, {"x": None, "u": 4, "U": 8}[esc]
            while self._peek() and self._peek() in _HEX and (limit is None or self.i - start < limit):
                self.i += 1
            digits = self.text[start : self.i]
            if not digits or (limit is not None and len(digits) != limit) or int(digits, 16) > 0x10FFFF:
                raise self._error(f"bad escape \\{esc}{digits}", start - 2)
            return chr(int(digits, 16))
        raise self._error(f"escape \\{esc} is not supported", self.i - 2)

    def _class(self) -> list[tuple[int, int]]:
        negated = self._peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        while True:
            start = self.i
            lo = self._char("]", _CLASS_META)
            if lo is None:
                break
            if self._peek() == "-" and self.text[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self._char("]", _CLASS_META)
                if hi is None or ord(hi) < ord(lo):
                    raise self._error("bad character range", start)
                ranges.append((ord(lo), ord(hi)))
            else:
                ranges.append((ord(lo), ord(lo)))
        if not ranges and not negated:
            raise self._error("an empty character class matches nothing")
        ranges = _normalize(ranges)
        return _complement(ranges) if negated else ranges

    def _quantified(self, node: object) -> object:
        ch = self._peek()
        if ch in ("*", "+", "?"):
            self.i += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
        elif ch == "{":
            low, high = self._counted()
        else:
            return node
        if self._peek() in ("*", "+", "?", "{"):
            raise self._error("two repetitions in a row: wrap the first in parentheses")
        return ("rep", node, low, high)

    def _counted(self) -> tuple[int, int | None]:
        start, end = self.i, self.text.find("}", self.i)
        low, comma, high = self.text[start + 1 : end].replace(" ", "").partition(",") if end > 0 else ("x", "", "")
        if not (low.isdigit() or (comma and not low)) or (high and not high.isdigit()):
            raise self._error("a repetition is {m}, {m,} or {m,n}")
        self.i = end + 1
        counts = (int(low or 0), int(low) if not comma else int(high) if high else None)
        if counts[1] is not None and counts[1] < counts[0]:
            raise self._error("bad repetition range", start)
        if max(counts[0], counts[1] or 0) > MAX_REPEAT:
            raise self._error(f"repetition counts over {MAX_REPEAT} are not supported", start)
        return counts
