"""Regular expressions as automata over UTF-8 bytes, for guided decoding (vLLM's
`guided_regex`): the output must match the whole pattern. Plain Python, no dependencies:
the API checks a pattern with it, the worker's grammar runs it.

The syntax is Python's `re` with ASCII classes (as under `re.ASCII`): literals and escapes,
`.` (any character but a newline), classes `[...]` / `[^...]` with ranges, `\\d \\w \\s` and
their negations, groups `(...)` and `(?:...)`, `|`, and the quantifiers `* + ? {m} {m,}
{m,n}` (lazy forms match the same text). `^` and `$` may stand at the ends. Anything else
(backreferences, lookarounds, `\\b`, inline flags) is a `RegexError` naming it.

A pattern becomes a Thompson NFA whose edges are byte ranges (each character class is split
into the UTF-8 byte sequences of its code points), run as a DFA built as it is walked: a
state is the frozen set of NFA states, the same for every copy of the pattern, so grammar
states can key shared caches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
MAX_NFA_STATES = 20_000  # what counted repetitions may expand to
MAX_REPEAT = 1000

_DIGIT = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20)]
_CLASS_ESCAPES = {"d": (_DIGIT, False), "D": (_DIGIT, True), "w": (_WORD, False), "W": (_WORD, True),
                  "s": (_SPACE, False), "S": (_SPACE, True)}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}
_META = set("\\.^$*+?{}[]()|/-")


class RegexError(ValueError):
    pass


# -- parsing: a small AST -----------------------------------------------------------------------
# ("set", ranges) | ("cat", [nodes]) | ("alt", [nodes]) | ("rep", node, min, max or None)


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.i = 0

    def parse(self):
        if self.pattern.startswith("^"):
            self.i = 1
        node = self._alternation()
        if self.i < len(self.pattern):
            raise self._error("unbalanced ')'" if self._peek() == ")" else f"unexpected {self._peek()!r}")
        return node

    def _error(self, what: str) -> RegexError:
        return RegexError(f"regex {self.pattern!r}: {what} at position {self.i}")

    def _peek(self) -> str | None:
        return self.pattern[self.i] if self.i < len(self.pattern) else None

    def _take(self) -> str:
        if self.i >= len(self.pattern):
            raise self._error("unexpected end of pattern")
        ch = self.pattern[self.i]
        self.i += 1
        return ch

    def _alternation(self):
        branches = [self._sequence()]
        while self._peek() == "|":
            self.i += 1
            branches.append(self._sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def _sequence(self):
        items = []
        while self._peek() not in (None, "|", ")"):
            if self._peek() == "$" and self.i == len(self.pattern) - 1:
                self.i += 1  # an anchor at the very end: the whole output matches anyway
                break
            items.append(self._quantified(self._atom()))
        return items[0] if len(items) == 1 else ("cat", items)

    def _atom(self):
        ch = self._take()
        if ch == "(":
            if self.pattern.startswith("?:", self.i):
                self.i += 2
            elif self._peek() == "?":
                raise self._error("group extensions other than (?:...) are not supported")
            node = self._alternation()
            if self._take() != ")":
                raise self._error("missing ')'")
            return node
        if ch == "[":
            return ("set", self._class())
        if ch == ".":
            return ("set", _complement([(0x0A, 0x0A)]))
        if ch == "\\":
            return ("set", self._escape(in_class=False))
        if ch in "*+?" or (ch == "{" and self._counted(self.i - 1) is not None):
            raise self._error(f"nothing to repeat before {ch!r}")
        if ch in "^$":
            raise self._error(f"{ch!r} is supported only at the ends of the pattern")
        if ch == ")":
            raise self._error("unbalanced ')'")
        return ("set", [(ord(ch), ord(ch))])

    def _escape(self, in_class: bool) -> list[tuple[int, int]]:
        ch = self._take()
        if ch in _CLASS_ESCAPES:
            ranges, negated = _CLASS_ESCAPES[ch]
            return _complement(ranges) if negated else list(ranges)
        if ch in _CHAR_ESCAPES:
            return _point(_CHAR_ESCAPES[ch])
        if ch in "xuU":
            digits = {"x": 2, "u": 4, "U": 8}[ch]
            text = self.pattern[self.i : self.i + digits]
            self.i += digits
            try:
                return _point(chr(int(text, 16)))
            except ValueError:
                raise self._error(f"bad escape \\{ch}{text}") from None
        if ch in _META or not ch.isalnum():
            return _point(ch)
        if ch == "b" and in_class:
            return _point("\b")
        raise self._error(f"escape \\{ch} is not supported")

    def _class(self) -> list[tuple[int, int]]:
        negated = self._peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            ch = self._take()
            if ch == "]" and not first:
                break
            first = False
            if ch == "\\":
                lo_ranges = self._escape(in_class=True)
            elif ch == "[" and self._peek() in (":", "=", "."):
                raise self._error("POSIX classes are not supported")
            else:
                lo_ranges = _point(ch)
            if self._peek() == "-" and self.pattern[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self._take()
                hi_ranges = self._escape(in_class=True) if hi == "\\" else _point(hi)
                if len(lo_ranges) != 1 or len(hi_ranges) != 1 or lo_ranges[0][0] != lo_ranges[0][1] \
                        or hi_ranges[0][0] != hi_ranges[0][1]:
                    raise self._error("a range needs a single character at each end")
                lo, hi_point = lo_ranges[0][0], hi_ranges[0][0]
                if lo > hi_point:
                    raise self._error("bad character range")
                ranges.append((lo, hi_point))
            else:
                ranges.extend(lo_ranges)
        ranges = _normalize(ranges)
        return _complement(ranges) if negated else ranges

    def _quantified(self, node):
        while True:
            ch = self._peek()
            if ch in ("*", "+", "?"):
                self.i += 1
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
            elif ch == "{" and self._counted() is not None:
                low, high = self._counted_take()
            else:
                return node
            if self._peek() == "?":
                self.i += 1  # lazy: the same set of matches
            elif self._peek() == "+":
                raise self._error("possessive quantifiers are not supported")
            node = ("rep", node, low, high)

    def _counted(self, at: int | None = None) -> tuple[int, int | None] | None:
        """The {m}, {m,}, {,n} or {m,n} starting at `at` (default: here), if it is one."""
        at = self.i if at is None else at
        end = self.pattern.find("}", at)
        if end < 0:
            return None
        low, comma, high = self.pattern[at + 1 : end].partition(",")
        if not comma:
            return (int(low), int(low)) if low.isdigit() else None  # else `{` is a literal, as in Python
        if (low and not low.isdigit()) or (high and not high.isdigit()):
            return None
        return int(low or 0), int(high) if high else None  # an omitted bound: 0, or none

    def _counted_take(self) -> tuple[int, int | None]:
        counted = self._counted()
        assert counted is not None
        self.i = self.pattern.find("}", self.i) + 1
        low, high = counted
        if high is not None and high < low:
            raise self._error("bad repeat interval")
        if max(low, high or 0) > MAX_REPEAT:
            raise self._error(f"repeat counts over {MAX_REPEAT} are not supported")
        return low, high


def _point(ch: str) -> list[tuple[int, int]]:
    return [(ord(ch), ord(ch))]


def _normalize(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, start = [], 0
    for lo, hi in _normalize(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return out


# -- code point ranges as UTF-8 byte sequences -------------------------------------------------


def utf8_sequences(ranges: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The byte-range sequences whose UTF-8 strings are exactly the code points in `ranges`
    (surrogates excluded: they have no UTF-8 form)."""
    out: list[list[tuple[int, int]]] = []
    for lo, hi in ranges:
        for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)):
            _split(a, b, out)
    return out


def _split(lo: int, hi: int, out: list[list[tuple[int, int]]]) -> None:
    if lo > hi:
        return
    for boundary in (0x7F, 0x7FF, 0xFFFF):  # the encoding lengths change past these
        if lo <= boundary < hi:
            _split(lo, boundary, out)
            _split(boundary + 1, hi, out)
            return
    if hi <= 0x7F:
        out.append([(lo, hi)])
        return
    for i in range(1, 4):  # split until every continuation byte spans its whole range
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m:
                _split(lo, lo | m, out)
                _split((lo | m) + 1, hi, out)
                return
            if hi & m != m:
                _split(lo, (hi & ~m) - 1, out)
                _split(hi & ~m, hi, out)
                return
    out.append(list(zip(chr(lo).encode(), chr(hi).encode(), strict=True)))


# -- the automaton ---------------------------------------------------------------------------


@dataclass
class Regex:
    """A compiled pattern: `initial`, `step(state, byte)` (None when nothing can match any
    more), `accepts(state)`. States are frozen sets of NFA states."""

    pattern: str
    edges: list[list[tuple[int, int, int]]] = field(default_factory=list, repr=False)  # state -> (lo, hi, to)
    epsilon: list[list[int]] = field(default_factory=list, repr=False)
    accept: int = field(default=-1, repr=False)
    initial: frozenset[int] = field(default=frozenset(), repr=False)
    _steps: dict[tuple[frozenset[int], int], frozenset[int] | None] = field(default_factory=dict, repr=False)

    def step(self, state: frozenset[int], byte: int) -> frozenset[int] | None:
        key = (state, byte)
        if key not in self._steps:
            reached = {to for s in state for lo, hi, to in self.edges[s] if lo <= byte <= hi}
            self._steps[key] = self._closure(reached) if reached else None
        return self._steps[key]

    def accepts(self, state: frozenset[int]) -> bool:
        return self.accept in state

    def fullmatch(self, text: str) -> bool:
        state = self.initial
        for byte in text.encode():
            nxt = self.step(state, byte)
            if nxt is None:
                return False
            state = nxt
        return self.accepts(state)

    def _closure(self, states: set[int]) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            for to in self.epsilon[todo.pop()]:
                if to not in seen:
                    seen.add(to)
                    todo.append(to)
        return frozenset(seen)

    def _state(self) -> int:
        if len(self.edges) >= MAX_NFA_STATES:
            raise RegexError(f"regex {self.pattern!r} is too large once its repetitions are expanded")
        self.edges.append([])
        self.epsilon.append([])
        return len(self.edges) - 1

    def _build(self, node) -> tuple[int, int]:
        kind = node[0]
        start, end = self._state(), self._state()
        if kind == "set":
            for sequence in utf8_sequences(node[1]):
                at = start
                for k, (lo, hi) in enumerate(sequence):
                    to = end if k == len(sequence) - 1 else self._state()
                    self.edges[at].append((lo, hi, to))
                    at = to
        elif kind == "cat":
            at = start
            for item in node[1]:
                s, e = self._build(item)
                self.epsilon[at].append(s)
                at = e
            self.epsilon[at].append(end)
        elif kind == "alt":
            for branch in node[1]:
                s, e = self._build(branch)
                self.epsilon[start].append(s)
                self.epsilon[e].append(end)
        else:
            self._build_repeat(node, start, end)
        return start, end

    def _build_repeat(self, node, start: int, end: int) -> None:
        _, inner, low, high = node
        at = start
        for _ in range(low):
            s, e = self._build(inner)
            self.epsilon[at].append(s)
            at = e
        if high is None:  # any number more
            s, e = self._build(inner)
            self.epsilon[at].extend((s, end))
            self.epsilon[e].extend((s, end))
            return
        for _ in range(high - low):  # each optional copy may end the repetition
            s, e = self._build(inner)
            self.epsilon[at].extend((s, end))
            at = e
        self.epsilon[at].append(end)


@functools.lru_cache(maxsize=64)
def compile_regex(pattern: str) -> Regex:
    """The automaton of `pattern` (cached: requests with the same pattern share it and its
    DFA). RegexError (a ValueError) names what is not supported."""
    if not isinstance(pattern, str) or not pattern:
        raise RegexError(f"regex must be a non-empty string, got {pattern!r}")
    regex = Regex(pattern)
    start, end = regex._build(_Parser(pattern).parse())
    regex.accept = end
    regex.initial = regex._closure({start})
    return regex
