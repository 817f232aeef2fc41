"""EBNF grammars (structured outputs' `grammar`) against xgrammar, the backend vLLM hands them
to: on the texts either side writes by walking its grammar, and on those texts changed a
character at a time, both take the same bytes, refuse the same byte first and agree where the
text may end."""

from __future__ import annotations

import random

import pytest
import xgrammar as xgr

from producer.grammar.ebnf import EbnfError, compile_ebnf

GRAMMARS = {
    "arithmetic": r"""
root ::= expr ("=" expr)*
expr ::= term ([-+*/] term)*
term ::= num | "(" expr ")"
num  ::= [0-9]+
""",
    "json_string": r"""
root   ::= "\"" char* "\""
char   ::= [^"\\\x00-\x1f] | "\\" escape
escape ::= ["\\/bfnrt] | "u" [0-9A-Fa-f]{4}
""",
    "json": r"""
root ::= basic_array | basic_object
basic_any ::= basic_number | basic_string | basic_boolean | basic_null | basic_array | basic_object
basic_number ::= ("0" | "-"? [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
basic_string ::= (([\"] basic_string_1 [\"]))
basic_string_1 ::= "" | [^"\\\x00-\x1F] basic_string_1 | "\\" escape basic_string_1
escape ::= ["\\/bfnrt] | "u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]
basic_boolean ::= "true" | "false"
basic_null ::= "null"
basic_array ::= "[" ("" | ws basic_any (ws "," ws basic_any)*) ws "]"
basic_object ::= "{" ("" | ws basic_string ws ":" ws basic_any ( ws "," ws basic_string ws ":" ws basic_any)*) ws "}"
ws ::= [ \n\t]*
""",
    "sql": r"""
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
""",
    "counted": r"""
root       ::= identifier ("," identifier){0,4} ";"{2,} "!"{1,2} "?"{3}
identifier ::= [a-zA-Z_] [a-zA-Z0-9_]*
""",
    "unicode": r"""
root ::= [\u4e00-\u9fff]+ [^a-z\u00e9]{1,3} ("😀" | "\U0001F600\x41" | "é")? tail
tail ::= [^] [^\n]*  # any first character, a newline too
""",
    "left recursive": r"""
# rules that begin with themselves, read as the repetitions they mean (xgrammar takes them so)
root ::= expr
expr ::= expr "+" term | expr "-" term | term
term ::= term "*" num | num | "(" expr ")"
num ::= [0-9] | num [0-9]
""",
    "ambiguous": r"""
# alternatives that match alike, empty ones, and a group that may be empty
root ::= (a | b)* "!" ( ) opt-tail.x
a ::= "x" | ""
b ::= "x" "x"? | "xy"
opt-tail.x ::= ("\t" | "\x41")? |
               "yy"
""",
}
ALPHABET = "xyz019ABé中😀 \n\t\"\\{}[],:.-+*/=()!?;_"


def ours(text: bytes, grammar: str) -> tuple[int, bool]:
    """How many bytes the grammar takes before refusing one, and whether it may end there."""
    ebnf = compile_ebnf(grammar)
    state = ebnf.initial
    for i, byte in enumerate(text):
        nxt = ebnf.step(state, byte)
        if nxt is None:
            return i, ebnf.accepts(state)
        state = nxt
    return len(text), ebnf.accepts(state)


def theirs(text: bytes, compiled) -> tuple[int, bool]:
    matcher = xgr.GrammarMatcher(compiled)
    for i, byte in enumerate(text):
        if not matcher.accept_string(bytes([byte])):
            return i, matcher.is_completed()
    return len(text), matcher.is_completed()


def walk_ours(grammar: str, rng: random.Random, max_bytes: int = 60) -> bytes:
    ebnf = compile_ebnf(grammar)
    state, out = ebnf.initial, bytearray()
    while len(out) < max_bytes and not (ebnf.accepts(state) and rng.random() < 0.15):
        options = [b for b in range(256) if ebnf.step(state, b) is not None]
        if not options:
            break
        out.append(rng.choice(options))
        state = ebnf.step(state, out[-1])
    return bytes(out)


def walk_theirs(compiled, alphabet: str, rng: random.Random, max_chars: int = 60) -> bytes:
    matcher, out = xgr.GrammarMatcher(compiled), []
    while len(out) < max_chars and not (matcher.is_completed() and rng.random() < 0.15):
        for char in rng.sample(alphabet, len(alphabet)):
            trial = matcher.fork()
            if trial.accept_string(char):
                matcher = trial
                out.append(char)
                break
        else:
            break
    return "".join(out).encode()


def mutated(text: bytes, alphabet: str, rng: random.Random) -> bytes:
    chars = list(text.decode("utf-8", "replace"))
    at = rng.randrange(len(chars) + 1)
    what = rng.choice(("insert", "delete", "replace"))
    if what != "insert" and at < len(chars):
        del chars[at]
    if what != "delete":
        chars.insert(at, rng.choice(alphabet))
    return "".join(chars).encode()


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo([]))  # bytes only: no vocabulary


@pytest.mark.parametrize("name", GRAMMARS)
def test_texts_are_taken_and_refused_as_xgrammar_does(name: str, compiler: xgr.GrammarCompiler) -> None:
    grammar = GRAMMARS[name]
    compiled = compiler.compile_grammar(grammar)
    rng = random.Random(name)
    alphabet = "".join(sorted(set(ALPHABET + grammar)))  # the grammar's own characters too
    texts = [walk_ours(grammar, rng) for _ in range(25)] + [walk_theirs(compiled, alphabet, rng) for _ in range(25)]
    texts += [mutated(text, alphabet, rng) for text in texts for _ in range(3)]
    completed = 0
    for text in texts:
        assert ours(text, grammar) == theirs(text, compiled), text
        completed += ours(text, grammar) == (len(text), True)
    assert completed >= 50  # the walks' texts, and some of their changes, are whole sentences


def test_a_random_walk_stays_within_the_grammar_at_every_byte() -> None:
    """Every byte a walk takes is one the grammar allows there (xgrammar's walks are checked
    above; here the reverse: our walk's prefixes are all live in xgrammar)."""
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(GRAMMARS["json"])
    rng = random.Random(7)
    for _ in range(10):
        text = walk_ours(GRAMMARS["json"], rng, max_bytes=120)
        assert theirs(text, compiled)[0] == len(text)


def test_a_repetition_does_not_grow_the_state() -> None:
    """`[a-z]*` past its minimum comes back to the same state: the masks engine caches hit."""
    ebnf = compile_ebnf('root ::= "<" [a-z]* ">"')
    state = ebnf.step(ebnf.initial, ord("<"))
    again = ebnf.step(state, ord("q"))
    assert ebnf.step(again, ord("r")) == again


@pytest.mark.parametrize("grammar, message", [
    ('root ::= a', "line 1, column 10: rule 'a' is not defined"),
    ('foo ::= "x"', "no rule named 'root'"),
    ('root ::= "x"\nroot ::= "y"', "line 2, column 1: rule 'root' is defined twice"),
    ('root ::= root "a"', "rule 'root' only ever begins with itself"),
    ('root ::= x\nx ::= y? root\ny ::= "a"', "rule 'root' is left-recursive"),
    ('root ::= ("b"? root)* "a"', "rule 'root' is left-recursive"),
    ('root[temperature=0.7] ::= "a"', "rule options such as [temperature=...] are not supported"),
    ('root ::= TagDispatch(("<t>", t))\nt ::= "x"', "macros such as TagDispatch(...) are not supported"),
    ("root ::= 'a'", "string literals take double quotes"),
    ('root ::= "a"++', "two repetitions in a row"),
    ('root ::= "a', "missing closing '\"'"),
    ('root ::= "a\nb"', "a line break inside a literal"),
    ('root ::= "a"{3,1}', "bad repetition range"),
    ('root ::= "a"{x}', "a repetition is {m}, {m,} or {m,n}"),
    ('root ::= "a"{5000}', "repetition counts over"),
    ('root ::= []', "an empty character class matches nothing"),
    ('root ::= [z-a]', "bad character range"),
    ('root ::= [\\d]', "escape \\d is not supported"),
    ('root ::= "\\u12"', "bad escape \\u12"),
    ('root ::= ("a"', "missing ')'"),
    ('root ::= *', "nothing to repeat before '*'"),
    ('root ::= "a" ; "b"', "unexpected ';'"),
    ("   ", "grammar must be a non-empty string"),
])
def test_bad_grammars_are_refused_saying_what_and_where(grammar: str, message: str) -> None:
    with pytest.raises(EbnfError) as info:
        compile_ebnf(grammar)
    assert message in str(info.value)


def test_a_grammar_of_comments_only_has_no_rules() -> None:
    with pytest.raises(EbnfError, match="grammar has no rules"):
        compile_ebnf("# nothing here\n")
