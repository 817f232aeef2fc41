"""Regular expressions for guided decoding against Python's `re` (with ASCII classes): the
same strings match, over ASCII, multi-byte characters and newlines; and what is outside the
supported syntax is refused by name."""

from __future__ import annotations

import random
import re

import pytest

from producer.grammar.regex import RegexError, compile_regex, utf8_sequences

ALPHABET = list("abcxyzAB09 -_.@\n\t{},]é日本🙂ü")
# each with strings that match it, which are mutated into near misses too
PATTERNS = {
    r"\d{3}-\d{4}": ["123-4567"],
    r"(yes|no|maybe)": ["yes", "maybe"],
    r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?": ["Hello", "Hello World"],
    r"日本|🙂+": ["日本", "🙂🙂🙂"],
    r"[^a-c]*x": ["zzx", "日x", "\nx"],
    r"a.b": ["a日b", "a b"],
    r"(?:ab|a)*?b?": ["abab", "aab", ""],
    r"[\w.+-]+@[\w-]+\.[a-z]{2,}": ["john.doe@mail.com"],
    r"^\s*(true|false)\s*$": [" true ", "false\n"],
    r"[é-ü]+": ["éü", "ñ"],
    r"\D\W\S": ["a b", "日 x"],
    r"x{2,}y{,3}": ["xx", "xxxyyy"],
    r"[]a]+|[^]a]": ["]a]", "b"],
    r"a{0}b|(a|)+c": ["b", "aac", "c"],
    r"[\-a\]]+\{\}": ["-a]{}"],
    r"[0-9a-fA-F]{1,4}": ["fF0", "0"],
    r"\x41\u00e9\U0001F642": ["Aé🙂"],
    r"{a}|a{,}|a{x}": ["{a}", "aaa", "", "a{x}"],  # {,}: zero or more; {x}: a literal
    r".{3}": ["日本🙂", "abc"],
}


def mutations(text: str, rng: random.Random) -> list[str]:
    out = []
    for _ in range(20):
        i = rng.randrange(len(text) + 1)
        kind = rng.randrange(3)
        if kind == 0:
            out.append(text[:i] + rng.choice(ALPHABET) + text[i:])
        elif kind == 1 and text:
            out.append(text[:i] + text[i + 1 :])
        elif text:
            out.append(text[:i] + rng.choice(ALPHABET) + text[i + 1 :])
    return out


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_matches_what_python_re_matches(pattern):
    ours, theirs = compile_regex(pattern), re.compile(pattern, re.ASCII)
    rng = random.Random(pattern)
    examples = PATTERNS[pattern]
    texts = examples + [m for e in examples for m in mutations(e, rng)]
    texts += ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6))) for _ in range(500)]
    for example in examples:
        assert ours.fullmatch(example), example
    for text in texts:
        assert ours.fullmatch(text) == (theirs.fullmatch(text) is not None), text


def test_a_dead_end_is_known_at_once():
    """A prefix no match can begin steps to None: that is what lets guided decoding refuse
    a token as soon as it leaves the pattern."""
    regex = compile_regex(r"\d{3}-\d{4}")
    state = regex.initial
    for byte in b"12":
        state = regex.step(state, byte)
    assert state is not None and not regex.accepts(state)
    assert regex.step(state, ord("-")) is None and regex.step(state, ord("3")) is not None


def test_utf8_sequences_cover_exactly_the_code_points():
    rng = random.Random(0)
    ranges = [(0x41, 0x5A), (0xE9, 0x7FF), (0x800, 0xD7FF), (0xE000, 0x1F642), (0x10FFF0, 0x10FFFF)]
    sequences = utf8_sequences(ranges)
    points = [rng.randint(0, 0x10FFFF) for _ in range(3000)] + [0x40, 0x41, 0x5A, 0x7FF, 0x800, 0xD7FF, 0xE000]
    for point in points:
        if 0xD800 <= point <= 0xDFFF:
            continue
        data = chr(point).encode()
        matched = [s for s in sequences if len(s) == len(data)
                   and all(lo <= b <= hi for (lo, hi), b in zip(s, data, strict=True))]
        assert len(matched) == (1 if any(lo <= point <= hi for lo, hi in ranges) else 0), hex(point)


@pytest.mark.parametrize("pattern, message", [
    ("(a", "unexpected end"), ("a)", "unbalanced"), ("*a", "nothing to repeat"), ("a{2,1}", "bad repeat interval"),
    (r"\bfoo", r"escape \\b is not supported"), ("(?=a)", "group extensions"), ("(?i)a", "group extensions"),
    (r"(a)\1", r"escape \\1"), ("a++", "possessive"), ("[z-a]", "bad character range"), ("", "non-empty string"),
    ("a$b", "only at the ends"), ("a{1001}", "repeat counts over 1000"), ("(a{1000}){1000}", "too large"),
])
def test_unsupported_syntax_is_refused_by_name(pattern, message):
    with pytest.raises(RegexError, match=message):
        compile_regex(pattern)
