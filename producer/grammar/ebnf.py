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

Reading the text into expression trees is `producer.grammar.ebnf_reader`'s (and
`producer.grammar.lark`'s, for a Lark grammar); this module compiles and runs what they read.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

from producer.grammar.ebnf_reader import EbnfError, EbnfReader
from producer.grammar.lark import LarkReader, is_lark
from producer.grammar.regex import utf8_sequences

MAX_STACKS = 20_000  # parses one state may hold; an output past it can only stop
MAX_MOVES = 1 << 20  # steps of stacks kept for reuse (each a small frozen set)
ACCEPT = -1  # in a state: the output may end here

# Elements of an alternative: (LITERAL, bytes) | (CLASS, byte-range sequences) |
# (RULE, rule) | (REPEAT, rule, min, max or None)
LITERAL, CLASS, RULE, REPEAT = range(4)



# -- compiling: rules of alternatives of elements -------------------------------------------------


class _Compiler:
    def __init__(self, parsed: dict[str, tuple[object, int]], parser: EbnfReader) -> None:
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
    parser = LarkReader(text) if is_lark(text) else EbnfReader(text)
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
