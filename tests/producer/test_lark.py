"""Lark grammars (structured outputs' `grammar` without `::=`) against the `lark` library's
Earley parser: texts our automaton writes are sentences to Lark, and texts changed a character
at a time are taken or refused by both alike (Lark's own JSON grammar, %ignore WS and all,
among them)."""

from __future__ import annotations

import random

import lark
import pytest
from test_ebnf import ours as taken
from test_ebnf import walk_ours

from producer.grammar.ebnf import EbnfError, compile_ebnf

GRAMMARS = {
    "calculator": r"""
// expressions over numbers and names
start: expr
?expr: term (("+" | "-") term)*
?term: factor ("*" factor)*
     | "-" term  -> neg
factor: NUMBER | "(" expr ")" | NAME
NAME: /[a-z_][a-z0-9_]*/
%import common.NUMBER
""",
    "json": r"""
start: value
?value: object | array | ESCAPED_STRING | SIGNED_NUMBER | "true" | "false" | "null"
array: "[" [value ("," _WS? value)*] "]"
object: "{" [pair ("," _WS? pair)*] "}"
pair: ESCAPED_STRING ":" _WS? value
_WS: " "+
%import common (ESCAPED_STRING, SIGNED_NUMBER)
""",
    "shapes": r"""
start: item ~ 1..3 ";" tail?
item: ("a".."c" | "é") ~ 2 ["-" CNAME]
tail: /x(yz|w)*[0-9]{0,2}|q+/ | WORD WS_INLINE WORD
%import common.CNAME
%import common.WORD
%import common.WS_INLINE
""",
    "lark's json": r"""
?start: value
?value: object | array | string | SIGNED_NUMBER -> number | "true" -> true | "false" -> false | "null" -> null
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
""",
    "ignored comments": r"""
start: stmt+
stmt: NAME "=" DIGIT ";"
NAME: /[a-z]/
COMMENT: "#" /[a-z ]/ ~ 0..2 "\n"
%import common.DIGIT
%ignore " "
%ignore COMMENT
""",
    "regex": r"""
start: /(ab|c)+d?|e[0-9]{2}/ ";" TAIL
TAIL: /x(yz|w)*|q+/
""",
    "ignored around regexes": r"""
start: (/(ab|c)+d?/ | "e" /[0-9]{2}/) ";" /x(yz|w)*/
%ignore " "
""",
}
ALPHABET = 'abcqxyzw019é-_;+*()[]{}",: \t.e'


def ours(grammar: str, text: str) -> bool:
    data = text.encode()
    return taken(data, grammar) == (len(data), True)


def theirs(parser: lark.Lark, text: str) -> bool:
    try:
        parser.parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


def walk(grammar: str, rng: random.Random) -> str:
    return walk_ours(grammar, rng, max_bytes=40).decode("utf-8", "replace")


@pytest.mark.parametrize("name", GRAMMARS)
def test_sentences_are_larks(name: str) -> None:
    grammar = GRAMMARS[name]
    parser = lark.Lark(grammar, start="start")
    rng = random.Random(name)
    texts = [walk(grammar, rng) for _ in range(40)]
    sentences = [t for t in texts if ours(grammar, t)]
    assert len(sentences) >= 12
    assert all(theirs(parser, t) for t in sentences), [t for t in sentences if not theirs(parser, t)]
    for text in texts:
        for _ in range(4):
            at = rng.randrange(len(text) + 1)
            changed = text[:at] + rng.choice(["", rng.choice(ALPHABET)]) + text[at + rng.randint(0, 1):]
            assert ours(grammar, changed) == theirs(parser, changed), changed


@pytest.mark.parametrize("grammar, message", [
    ('start: "select"i', "case-insensitive literals"),
    ("start: /ab/i", "regular expression flags are not supported"),
    ("start: A\n%import common.NOPE", "common.NOPE is not one genq knows"),
    ("start: A\n%declare A", "only %import common.NAME is supported"),
    ('start: "a" ~ 3..1', "bad repetition range"),
    ('start: "b".."a"', "bad character range"),
    ("start: missing", "rule 'missing' is not defined"),
    ("start: /a(?=b)/", "not supported"),
    ('start: "a"\nstart: "b"', "rule 'start' is defined twice"),
    ('start: a\na: b "x" | "y"\nb: a "z"', "rule 'a' is left-recursive"),  # (through another rule)
])
def test_what_genq_does_not_read_is_refused_by_name(grammar: str, message: str) -> None:
    with pytest.raises(EbnfError, match="grammar") as info:
        compile_ebnf(grammar)
    assert message in str(info.value)


def test_the_output_begins_at_start_else_at_the_first_rule() -> None:
    assert ours('other: "x"\nstart: "y"', "y") and not ours('other: "x"\nstart: "y"', "x")
    assert ours('first: "x" second\nsecond: "y"', "xy")
