"""Context-free grammars for guided decoding (vLLM's structured outputs `grammar`): the output
must be a sentence of the grammar. Plain Python, no dependencies: the API checks a grammar
with it, the worker's grammar runs it.

The syntax is xgrammar's EBNF, which vLLM hands such grammars to (a superset of llama.cpp's
GBNF; a grammar without `::=` is Lark's, as vLLM tells them apart, read by `producer.grammar.lark` into
the same rules): rules `name ::= expression`, each starting its line, entered at `root`; string
literals `"..."` with escapes (`\\n \\t \\xHH \\uXXXX ...`), character classes `[a-z]`,
`[^"\\\\]`, `[^]` (over Unicode code points), rule references, groups `( ... )`,
alternatives `|`, and the repetitions `? * + {m} {m,} {m,n}`; `#` comments. A rule that
begins with itself (`expr ::= expr "+" term | term`) is read as the repetition it means
(`term ("+" term)*`). Rule options (`name[temperature=...]`) and macros (`TagDispatch(...)`,
`Token(...)`) are refused by name, as is left recursion through other rules or an empty
prefix (write the repetition with `*`).

The grammar runs as a pushdown automaton over UTF-8 bytes whose state is the set of every
stack a parse can be in (a generalized LR-style search: an ambiguous grammar keeps each
reading until the text tells them apart). A stack is a chain of frames `(rule, alternative,
element, within)`; `within` is the byte offset inside a literal, the place inside a
character's UTF-8 bytes, or a repetition's count (one past its minimum for an unbounded
one, so `[a-z]*` does not grow the state). Stacks are interned as integers and each one's
step by a byte is kept, so a grammar becomes, as it is walked, a DFA over sets of stacks;
states are frozen sets of those integers, the same for every request that shares the
compiled grammar.
"""

from __future__ import annotations

import functools
import itertools
import re
from dataclasses import dataclass
from typing import Any

from producer.grammar.regex import MAX_REPEAT, _complement, _normalize, utf8_sequences

ROOT = "root"
MAX_STACKS = 20_000  # parses one state may hold; an output past it can only stop
MAX_MOVES = 1 << 20  # steps of stacks kept for reuse (each a small frozen set)
ACCEPT = -1  # in a state: the output may end here

# Elements of an alternative: (LITERAL, bytes) | (CLASS, byte-range sequences) |
# (RULE, rule) | (REPEAT, rule, min, max or None)
LITERAL, CLASS, RULE, REPEAT = range(4)

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


class _Parser:
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


# -- compiling: rules of alternatives of elements -------------------------------------------------


class _Compiler:
    def __init__(self, parsed: dict[str, tuple[object, int]], parser: _Parser) -> None:
        self.parser = parser
        self.ids = {name: i for i, name in enumerate(parsed)}
        self.names = list(parsed)
        self.rules: list[list[tuple[tuple, ...]]] = [[] for _ in parsed]
        for name, (expr, _) in parsed.items():
            self.current = name  # what a group inside it is named after
            self.rules[self.ids[name]] = self._alternatives(expr)
        for rule in range(len(parsed)):
            self._unloop(rule)

    def _unloop(self, rule: int) -> None:
        """Direct left recursion, `A ::= A x | A y | b | c`, as the same language without it:
        `A ::= (b | c) (x | y)*` (a parse stack would otherwise grow without reading)."""
        alternatives = self.rules[rule]
        tails = [alt[1:] for alt in alternatives if alt and alt[0] == (RULE, rule)]
        if not tails:
            return
        starts = [alt for alt in alternatives if not alt or alt[0] != (RULE, rule)]
        if not starts:
            raise EbnfError(f"grammar rule {self.names[rule]!r} only ever begins with itself: it matches nothing")
        self.current = self.names[rule]
        first, rest = self._new_rule(starts), self._new_rule(tails)
        self.rules[rule] = [((RULE, first), (REPEAT, rest, 0, None))]

    def _new_rule(self, alternatives: list[tuple[tuple, ...]]) -> int:
        self.rules.append(alternatives)
        self.names.append(self.current)
        return len(self.rules) - 1

    def _alternatives(self, expr) -> list[tuple[tuple, ...]]:
        branches = expr[1] if expr[0] == "alt" else [expr]
        return [self._sequence(branch) for branch in branches]

    def _sequence(self, expr) -> tuple[tuple, ...]:
        items = expr[1] if expr[0] == "seq" else [expr]
        out: list[tuple] = []
        for item in items:
            out.extend(self._elements(item))
        return tuple(out)

    def _elements(self, expr) -> list[tuple]:
        kind = expr[0]
        if kind == "tok":  # (producer.grammar.lark: a regular expression, one token of a Lark grammar)
            return self._elements(expr[1])
        if kind == "lit":
            data = expr[1].encode("utf-8", "surrogatepass")
            return [(LITERAL, data)] if data else []
        if kind == "cls":
            return [(CLASS, _sequences(expr[1]))]
        if kind == "ref":
            if expr[1] not in self.ids:
                raise self.parser._error(f"rule {expr[1]!r} is not defined", expr[2])
            return [(RULE, self.ids[expr[1]])]
        if kind == "seq":
            return [e for item in expr[1] for e in self._elements(item)]
        if kind == "alt":
            return [(RULE, self._anonymous(expr))]
        _, inner, low, high = expr
        if high == 0:
            return []
        target = self.ids[inner[1]] if inner[0] == "ref" and inner[1] in self.ids else self._anonymous(inner)
        if low == high == 1:
            return [(RULE, target)]
        return [(REPEAT, target, low, high)]

    def _anonymous(self, expr) -> int:
        rule = self._new_rule([])
        self.rules[rule] = self._alternatives(expr)
        return rule


def _sequences(ranges: list[tuple[int, int]]) -> tuple[tuple[tuple[int, int], ...], ...]:
    return tuple(tuple(seq) for seq in utf8_sequences(ranges))


def _nullable(rules: list[list[tuple[tuple, ...]]]) -> set[int]:
    nullable: set[int] = set()
    changed = True
    while changed:
        changed = False
        for r, alternatives in enumerate(rules):
            if r not in nullable and any(all(_empty(e, nullable) for e in alt) for alt in alternatives):
                nullable.add(r)
                changed = True
    return nullable


def _empty(element: tuple, nullable: set[int]) -> bool:
    kind = element[0]
    if kind in (LITERAL, CLASS):
        return False
    if kind == REPEAT and element[2] == 0:
        return True
    return element[1] in nullable


def _left_recursive(rules: list[list[tuple[tuple, ...]]], nullable: set[int]) -> int | None:
    """A rule that can begin with itself (its parse stack would grow without reading), or None."""
    begins: list[set[int]] = [set() for _ in rules]
    for r, alternatives in enumerate(rules):
        for alt in alternatives:
            for element in alt:
                if element[0] in (RULE, REPEAT):
                    begins[r].add(element[1])
                if not _empty(element, nullable):
                    break
    for start in range(len(rules)):
        seen, todo = set(), list(begins[start])
        while todo:
            r = todo.pop()
            if r == start:
                return start
            if r not in seen:
                seen.add(r)
                todo.extend(begins[r])
    return None


# -- the automaton ------------------------------------------------------------------------------

Frame = tuple[int, int, int, Any]  # (rule, alternative, element, within)
_serial = itertools.count()


@dataclass(eq=False)
class Ebnf:
    """A compiled grammar: `initial`, `step(state, byte)` (None when no parse can go on),
    `accepts(state)`. States are frozen sets of interned stacks (and ACCEPT)."""

    text: str
    rules: list[list[tuple[tuple, ...]]]
    root: int

    def __post_init__(self) -> None:
        self.serial = next(_serial)  # stacks are numbered per compiled grammar
        self._stacks: list[tuple[Frame, int]] = []  # stack id -> (its top frame, the rest's id; -1: none)
        self._ids: dict[tuple[Frame, int], int] = {}
        self._moves: dict[tuple[int, int], frozenset[int]] = {}  # (stack, byte) -> what it becomes
        out: set[int] = set()
        for alt in range(len(self.rules[self.root])):
            self._expand((self.root, alt, 0, 0), -1, out)
        self.initial = frozenset(out)

    def step(self, state: frozenset[int], byte: int) -> frozenset[int] | None:
        reached: set[int] = set()
        for stack in state:
            if stack != ACCEPT:
                move = self._moves.get((stack, byte))
                if move is None:
                    if len(self._moves) >= MAX_MOVES:  # a long-lived grammar's walks: start afresh
                        self._moves.clear()
                    move = self._moves[(stack, byte)] = self._move(stack, byte)
                reached |= move
        if not reached or len(reached) > MAX_STACKS:
            return None
        return frozenset(reached)

    def accepts(self, state: frozenset[int]) -> bool:
        return ACCEPT in state

    def _intern(self, frame: Frame, rest: int) -> int:
        key = (frame, rest)
        stack = self._ids.get(key)
        if stack is None:
            stack = self._ids[key] = len(self._stacks)
            self._stacks.append(key)
        return stack

    def _move(self, stack: int, byte: int) -> frozenset[int]:
        """The stacks a stack waiting on a literal or class becomes after `byte`."""
        (rule, alt, at, within), rest = self._stacks[stack]
        element = self.rules[rule][alt][at]
        out: set[int] = set()
        if element[0] == LITERAL:
            data = element[1]
            if data[within] == byte:
                if within + 1 < len(data):
                    out.add(self._intern((rule, alt, at, within + 1), rest))
                else:
                    self._expand((rule, alt, at + 1, 0), rest, out)
            return frozenset(out)
        sequences = element[1]
        offset, alive = within if within else (0, range(len(sequences)))
        going: list[int] = []
        for k in alive:
            lo, hi = sequences[k][offset]
            if lo <= byte <= hi:
                if offset + 1 == len(sequences[k]):
                    self._expand((rule, alt, at + 1, 0), rest, out)
                else:
                    going.append(k)
        if going:
            out.add(self._intern((rule, alt, at, (offset + 1, tuple(going))), rest))
        return frozenset(out)

    def _expand(self, frame: Frame, rest: int, out: set[int]) -> None:
        """Add to `out` every stack waiting on a byte that `(frame, rest)` reaches without
        reading one (ACCEPT where the root completes)."""
        todo, seen = [(frame, rest)], set()
        while todo:
            item = todo.pop()
            if item in seen:
                continue
            seen.add(item)
            (rule, alt, at, within), rest = item
            elements = self.rules[rule][alt]
            if at == len(elements):  # the rule is done: back to the frame that called it
                if rest < 0:
                    out.add(ACCEPT)
                else:
                    todo.append(self._resume(rest))
                continue
            element = elements[at]
            kind = element[0]
            if kind in (LITERAL, CLASS):
                out.add(self._intern(*item))
                continue
            target = element[1]
            if kind == REPEAT:
                low, high = element[2], element[3]
                if within >= low:
                    todo.append(((rule, alt, at + 1, 0), rest))
                if high is not None and within >= high:
                    continue
            caller = self._intern(*item)
            todo.extend(((target, k, 0, 0), caller) for k in range(len(self.rules[target])))

    def _resume(self, caller: int) -> tuple[Frame, int]:
        """The calling frame once the rule it called is done: past a reference, or one more
        round of a repetition."""
        (rule, alt, at, within), rest = self._stacks[caller]
        element = self.rules[rule][alt][at]
        if element[0] == RULE:
            return (rule, alt, at + 1, 0), rest
        count = within + 1
        if element[3] is None:
            count = min(count, element[2])  # past the minimum, the count no longer matters
        return (rule, alt, at, count), rest


@functools.lru_cache(maxsize=64)
def compile_ebnf(text: str) -> Ebnf:
    """The automaton of the grammar `text` (cached: requests with the same grammar share it
    and the steps it has walked). EbnfError (a ValueError) names what is wrong and where."""
    if not isinstance(text, str) or not text.strip():
        raise EbnfError(f"grammar must be a non-empty string, got {text!r}")
    from producer.grammar.lark import LarkReader, is_lark  # (it reads into this module's rules)

    parser = LarkReader(text) if is_lark(text) else _Parser(text)
    parsed = parser.parse()
    root = parser.root(parsed)
    if root not in parsed:
        raise EbnfError(f"grammar has no rule named {root!r}, where the output begins")
    compiler = _Compiler(parsed, parser)
    recursive = _left_recursive(compiler.rules, _nullable(compiler.rules))
    if recursive is not None:
        raise EbnfError(
            f"grammar rule {compiler.names[recursive]!r} is left-recursive (it can begin with itself): "
            "write the repetition with * or + instead"
        )
    return Ebnf(text, compiler.rules, compiler.ids[root])
