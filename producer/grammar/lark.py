"""Lark grammars for guided decoding (vLLM takes a `grammar` with no `::=` as Lark and converts
it; OpenAI's custom tools write theirs in Lark), read into `producer.grammar.ebnf`'s rules, which then
run as any EBNF grammar does. The language is what Lark's Earley parser accepts with its
dynamic lexer (its default): rules and terminals alike are rules over the text.

Read: `name: expansions` for rules (`?name`, `!name`, `name.2` too) and TERMINALS, `|` (on the
next line too), `"literals"` (and `'literals'`), `"a".."z"`, `/regular expressions/`
(`producer.grammar.regex`'s syntax, no flags), `(groups)`, `[optional]`, `? * +`, `~ n` and `~ n..m`,
`-> alias` (dropped: it names a tree node, not text), `//` (and `#`) comments, `%import common.NAME`
for the usual terminals (DIGIT, INT, NUMBER, WORD, CNAME, ESCAPED_STRING, WS, ...), and
`%ignore` (what it names may stand before any token of a rule and at the end, as Lark's lexer
skips it). The output begins at `start` (else at the first rule). Refused by name: other
directives and imports, case-insensitive literals and regex flags.
"""

from __future__ import annotations

import re

from producer.grammar.ebnf_reader import EbnfError, EbnfReader
from producer.grammar.regex import RegexError
from producer.grammar.regex import _Parser as _RegexParser

START = "start"
_NAME = re.compile(r"[?!]?(_?[A-Za-z][A-Za-z0-9_]*)(\.-?\d+)?[ \t]*:")
_REF = re.compile(r"_?[A-Za-z][A-Za-z0-9_]*")
# Lark's common.lark terminals, as Lark grammars (read by this reader)
COMMON = {
    "DIGIT": '"0".."9"',
    "HEXDIGIT": '"a".."f" | "A".."F" | DIGIT',
    "INT": "DIGIT+",
    "SIGNED_INT": '["+" | "-"] INT',
    "DECIMAL": 'INT "." INT? | "." INT',
    "_EXP": '("e" | "E") SIGNED_INT',
    "FLOAT": "INT _EXP | DECIMAL _EXP?",
    "SIGNED_FLOAT": '["+" | "-"] FLOAT',
    "NUMBER": "FLOAT | INT",
    "SIGNED_NUMBER": '["+" | "-"] NUMBER',
    "ESCAPED_STRING": '"\\"" (/[^"\\\\\\n]/ | "\\\\" /[^\\n]/)* "\\""',
    "LCASE_LETTER": '"a".."z"',
    "UCASE_LETTER": '"A".."Z"',
    "LETTER": "UCASE_LETTER | LCASE_LETTER",
    "WORD": "LETTER+",
    "CNAME": '("_" | LETTER) ("_" | LETTER | DIGIT)*',
    "WS_INLINE": '(" " | /\\t/)+',
    "WS": "/[ \\t\\f\\r\\n]/+",
    "CR": "/\\r/",
    "LF": "/\\n/",
    "NEWLINE": "(CR? LF)+",
}


def is_lark(text: str) -> bool:
    """vLLM's test: a grammar none of whose lines (comments aside) holds `::=`."""
    return not any("::=" in re.sub(r"(#|//).*$", "", line) for line in text.splitlines())


class LarkReader(EbnfReader):
    """A Lark grammar as `producer.grammar.ebnf_reader`'s parsed rules (name -> (expression, where))."""

    def parse(self) -> dict[str, tuple[object, int]]:
        rules: dict[str, tuple[object, int]] = {}
        imports: list[tuple[str, int]] = []
        self.ignored: list[tuple[object, int]] = []  # %ignore's items
        while True:
            self._skip_lark(newlines=True)
            if self.i >= len(self.text):
                break
            at = self.i
            if self._peek() == "%":
                imports += self._directive()
                continue
            match = _NAME.match(self.text, self.i)
            if match is None:
                raise self._error("expected a definition `name: ...` or a %directive")
            name = match.group(1)
            if name in rules:
                raise self._error(f"rule {name!r} is defined twice", at)
            self.i = match.end()
            rules[name] = (self._expansions(), at)
        for name, at in imports:
            self._import(name, at, rules)
        if not rules:
            raise EbnfError("grammar has no rules")
        if self.ignored:
            self._weave_ignored(rules)
        return rules

    def _weave_ignored(self, rules: dict[str, tuple[object, int]]) -> None:
        """%ignore: what it names may stand before any token of a rule (a terminal, a literal,
        a regular expression) and at the end of the text, as Lark's lexer skips it there."""
        ignore = ("rep", ("ref", IGNORED, 0), 0, None)
        root = self.root(rules)
        rules[IGNORED] = (self.ignored[0][0] if len(self.ignored) == 1 else ("alt", [e for e, _ in self.ignored]), 0)
        for name, (expr, at) in list(rules.items()):
            if name == IGNORED or _is_terminal(name):
                continue
            woven = _before_tokens(expr, ignore)
            rules[name] = (("seq", [woven, ignore]) if name == root else woven, at)

    def root(self, rules: dict[str, tuple[object, int]]) -> str:
        return START if START in rules else next(iter(rules))

    def _skip_lark(self, newlines: bool) -> None:
        while self.i < len(self.text):
            if self.text.startswith(("//", "#"), self.i):  # (Lark's comments; vLLM drops #'s too)
                end = self.text.find("\n", self.i)
                self.i = len(self.text) if end < 0 else end
            elif self.text[self.i] in " \t\r" or (newlines and self.text[self.i] == "\n"):
                self.i += 1
            else:
                return

    def _continues(self) -> bool:
        """At a line's end: whether the next line goes on with `|` (then there, else back)."""
        start = self.i
        self._skip_lark(newlines=True)
        if self._peek() == "|":
            return True
        self.i = start
        return False

    def _directive(self) -> list[tuple[str, int]]:
        at = self.i
        line_end = self.text.find("\n", self.i)
        line = self.text[self.i : len(self.text) if line_end < 0 else line_end]
        self.i += len(line)
        line = re.sub(r"(//|#).*$", "", line).strip()
        if line.startswith("%ignore"):
            reader = LarkReader(line.removeprefix("%ignore") + "\n")
            self.ignored.append((reader._expansions(), at))
            names = _REF.findall(re.sub(r'"[^"]*"|/[^/]*/', "", line.removeprefix("%ignore")))
            return [(n, at) for n in names if n in COMMON]  # `%ignore WS` imports it where it is common's
        match = re.fullmatch(r"%import\s+common\.(\w+)|%import\s+common\s*\(([\w\s,]+)\)", line)
        if match is None:
            raise self._error(f"only %import common.NAME is supported, got {line!r}", at)
        names = [match.group(1)] if match.group(1) else [n.strip() for n in match.group(2).split(",") if n.strip()]
        return [(n, at) for n in names]

    def _import(self, name: str, at: int, rules: dict[str, tuple[object, int]]) -> None:
        if name in rules:
            return
        if name not in COMMON:
            raise self._error(f"common.{name} is not one genq knows: {', '.join(sorted(COMMON))}", at)
        reader = LarkReader(f"{name}: {COMMON[name]}\n")
        rules.update(reader.parse())
        for ref in _REF.findall(COMMON[name]):
            if ref in COMMON:
                self._import(ref, at, rules)

    def _expansions(self) -> object:
        branches = [self._alias_sequence()]
        while True:
            self._skip_lark(newlines=False)
            if self._peek() == "|" or (self._peek() == "\n" and self._continues()):
                self.i += 1
                branches.append(self._alias_sequence())
            else:
                break
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def _alias_sequence(self) -> object:
        items = []
        while True:
            self._skip_lark(newlines=False)
            ch = self._peek()
            if ch in ("", "\n", "|", ")", "]"):
                break
            if self.text.startswith("->", self.i):  # an alias names the tree node: no text
                self.i += 2
                self._skip_lark(newlines=False)
                if _REF.match(self.text, self.i) is None:
                    raise self._error("expected a name after '->'")
                self.i = _REF.match(self.text, self.i).end()  # type: ignore[union-attr]
                continue
            items.append(self._lark_quantified(self._lark_atom()))
        return items[0] if len(items) == 1 else ("seq", items)

    def _lark_atom(self) -> object:
        at, ch = self.i, self._peek()
        if ch in ('"', "'"):
            self.i += 1
            text = self._quoted(ch)
            if self._peek() == "i":
                raise self._error("case-insensitive literals (\"...\"i) are not supported", at)
            if self.text.startswith("..", self.i):
                self.i += 2
                self._skip_lark(newlines=False)
                quote = self._peek()
                if quote not in ('"', "'"):
                    raise self._error("a range is \"a\"..\"z\"")
                self.i += 1
                high = self._quoted(quote)
                if len(text) != 1 or len(high) != 1 or ord(high) < ord(text):
                    raise self._error("bad character range", at)
                return ("cls", [(ord(text), ord(high))])
            return ("lit", text)
        if ch == "/":
            return self._regex()
        if ch in ("(", "["):
            self.i += 1
            inner = self._expansions()
            self._skip_lark(newlines=True)
            close = ")" if ch == "(" else "]"
            if self._peek() != close:
                raise self._error(f"missing {close!r}")
            self.i += 1
            return inner if ch == "(" else ("rep", inner, 0, 1)
        match = _REF.match(self.text, self.i)
        if match is not None:
            self.i = match.end()
            return ("ref", match.group(0), at)
        raise self._error(f"unexpected {ch!r}")

    def _quoted(self, quote: str) -> str:
        out: list[str] = []
        while (ch := self._char(quote)) is not None:
            out.append(ch)
        return "".join(out)

    def _regex(self) -> object:
        at = self.i
        end = self.i + 1
        while end < len(self.text) and self.text[end] != "/":
            if self.text[end] == "\n":
                raise self._error("a regular expression ends on its line", at)
            end += 2 if self.text[end] == "\\" else 1
        if end >= len(self.text):
            raise self._error("missing closing '/'", at)
        pattern, self.i = self.text[at + 1 : end].replace("\\/", "/"), end + 1
        if self._peek().isalpha():
            raise self._error("regular expression flags are not supported", at)
        try:
            return ("tok", _from_regex(_RegexParser(pattern).parse()))  # one token, whatever its parts
        except RegexError as exc:
            raise self._error(str(exc), at) from None

    def _lark_quantified(self, node: object) -> object:
        self._skip_lark(newlines=False)
        ch = self._peek()
        if ch in ("?", "*", "+"):
            self.i += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
            return ("rep", node, low, high)
        if ch == "~":
            self.i += 1
            self._skip_lark(newlines=False)
            match = re.compile(r"(\d+)(?:\s*\.\.\s*(\d+))?").match(self.text, self.i)
            if match is None:
                raise self._error("a repetition is ~ n or ~ n..m")
            self.i = match.end()
            low = int(match.group(1))
            high = int(match.group(2)) if match.group(2) else low
            if high < low:
                raise self._error("bad repetition range")
            return ("rep", node, low, high)
        return node


IGNORED = "__ignored"  # the rule %ignore's items make


def _is_terminal(name: str) -> bool:
    return name.lstrip("_")[:1].isupper()


def _before_tokens(expr, ignore) -> object:
    """`expr` with `ignore` put before each token it holds (terminals, literals, classes)."""
    kind = expr[0]
    if kind in ("lit", "cls", "tok") or (kind == "ref" and _is_terminal(expr[1])):
        return ("seq", [ignore, expr])
    if kind in ("seq", "alt"):
        return (kind, [_before_tokens(e, ignore) for e in expr[1]])
    if kind == "rep":
        return ("rep", _before_tokens(expr[1], ignore), expr[2], expr[3])
    return expr


def _from_regex(node) -> object:
    """producer.grammar.regex's tree as ebnf's: sets as classes, the rest alike."""
    kind = node[0]
    if kind == "set":
        return ("cls", node[1])
    if kind == "cat":
        return ("seq", [_from_regex(n) for n in node[1]])
    if kind == "alt":
        return ("alt", [_from_regex(n) for n in node[1]])
    return ("rep", _from_regex(node[1]), node[2], node[3])
