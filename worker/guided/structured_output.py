"""Structured output: grammars that say which text may come next, and the per-request token
masks built from them (vLLM's `guided_decoding`: `json_object`, `json_schema`, `choice`,
`regex`, `grammar`, `structural_tag`; the JSON grammars are in `worker.guided.json_grammar` and
`worker.guided.json_schema_grammar`, regular expressions in `producer.grammar.regex`, EBNF grammars in
`producer.grammar.ebnf`, structural tags in `worker.guided.structural_tag`).

A grammar is an automaton over immutable, hashable states that reads the output's UTF-8
bytes, one character per byte (`worker.guided.token_bytes.byte_text`), so a token holding part of a
character has an exact meaning: `advance(state, text)` returns the state after `text`, or
None when no completion of the output could begin with it; `is_complete(state)` says the
output may end there. The mask of a state is the set of vocabulary tokens whose bytes
(`worker.guided.token_bytes`) keep the output valid; it is computed once per state and cached, so a request whose state repeats (inside a
string, after a comma at the same depth) costs nothing after the first time. Where the output
may end, the stop tokens are allowed too (they alone once nothing can extend it).

Plain Python (no torch): the engine turns the token ids into a mask tensor.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from producer.grammar.ebnf import compile_ebnf
from producer.grammar.regex import compile_regex
from worker.guided.json_grammar import COMPACT_JSON_OBJECT, JSON_OBJECT
from worker.guided.json_schema_grammar import JsonSchemaGrammar
from worker.guided.structural_tag import StructuralTagGrammar
from worker.guided.token_bytes import byte_text, special_texts, token_bytes

MASK_CACHE_SIZE = 1024  # grammar states whose masks are kept (a mask is one byte per token)


class Grammar(Protocol):
    key: Hashable  # equal for grammars that accept the same text: masks are shared by it

    def initial(self) -> Hashable: ...

    def advance(self, state: Hashable, text: str) -> Hashable | None: ...

    def is_complete(self, state: Hashable) -> bool: ...


def make_grammar(guided_decoding: dict[str, Any]) -> Grammar:
    """`{"json_object": True}`, `{"json_schema": {...}}`, `{"choice": [...]}`,
    `{"regex": pattern}`, `{"grammar": ebnf}` or `{"structural_tag": {"structures",
    "triggers"}}` (SamplingParams checked the shape, and that the schema, pattern or grammar
    compiles); JSON with `"disable_any_whitespace": True` is written compact."""
    compact = bool(guided_decoding.get("disable_any_whitespace"))
    if guided_decoding.get("json_object"):
        return COMPACT_JSON_OBJECT if compact else JSON_OBJECT
    if "json_schema" in guided_decoding:
        return JsonSchemaGrammar(guided_decoding["json_schema"], compact=compact)
    if "regex" in guided_decoding:
        return regex_grammar(guided_decoding["regex"])
    if "grammar" in guided_decoding:
        return ebnf_grammar(guided_decoding["grammar"])
    if "structural_tag" in guided_decoding:
        return StructuralTagGrammar(guided_decoding["structural_tag"])
    return ChoiceGrammar(guided_decoding["choice"])


class AutomatonGrammar:
    """A grammar run by a byte automaton of `producer`'s (`initial`, `step(state, byte)`,
    `accepts(state)`): a regular expression's DFA, or a context-free grammar's sets of parse
    stacks. A state is the automaton's, shared by every request with the same automaton."""

    def __init__(self, automaton: Any, key: Hashable) -> None:
        self.automaton = automaton
        self.key = key

    def initial(self) -> Hashable:
        return self.automaton.initial

    def advance(self, state: Hashable, text: str) -> Hashable | None:
        current = state
        for ch in text:  # one byte per character (byte_text)
            current = self.automaton.step(current, ord(ch))
            if current is None:
                return None
        return current

    def is_complete(self, state: Hashable) -> bool:
        return self.automaton.accepts(state)


def regex_grammar(pattern: str) -> AutomatonGrammar:
    """The output matches the pattern whole. A state is the pattern's DFA state (a frozen
    set of NFA states, numbered alike whenever the pattern is compiled)."""
    return AutomatonGrammar(compile_regex(pattern), ("regex", pattern))


def ebnf_grammar(text: str) -> AutomatonGrammar:
    """The output is a sentence of the EBNF grammar. A state is a frozen set of parse
    stacks, numbered by the compiled grammar as it is walked: masks are shared by requests
    sharing that compilation (`compile_ebnf` keeps the recent ones), not across them."""
    ebnf = compile_ebnf(text)
    return AutomatonGrammar(ebnf, ("grammar", ebnf.serial))


class ChoiceGrammar:
    """The output is exactly one of the given strings. A state is the bytes so far."""

    def __init__(self, choices: Sequence[str]) -> None:
        self.choices = tuple(byte_text(c.encode()) for c in choices)
        self.key: Hashable = ("choice", self.choices)

    def initial(self) -> Hashable:
        return ""

    def advance(self, state: Hashable, text: str) -> Hashable | None:
        new = f"{state}{text}"
        return new if any(c.startswith(new) for c in self.choices) else None

    def is_complete(self, state: Hashable) -> bool:
        return state in self.choices


# ---------------------------------------------------------------------------------------------
# Token masks


@dataclass
class GuidedState:
    """One request's progress through its grammar."""

    grammar: Grammar
    state: Hashable | None  # None: the output can no longer fit the grammar (it may only stop)
    num_tokens: int = 0  # output tokens consumed so far
    after: str | None = None  # the grammar starts after this text; until then the output is free
    seen: str = ""  # while waiting for `after`: the output's tail that may begin it


class TokenMasks:
    """The allowed next tokens of grammar states over one vocabulary, as masks: bytes of the
    vocabulary's length, 1 where the token may come next.

    `vocabulary[i]` is the bytes token i stands for; None (special tokens) is not allowed
    inside the output, unless the grammar `reads_special_tokens` (a structural tag, whose
    trigger may be one: Llama's `<|python_tag|>`): then a special token is taken by its text,
    from `special_texts`, as xgrammar takes it. `special_texts` also spell special tokens for
    markers: a grammar may start after one (gpt-oss's `<|channel|>final<|message|>`).
    """

    def __init__(
        self, vocabulary: Sequence[bytes | None], stop_ids: set[int],
        cache_size: int = MASK_CACHE_SIZE, special_texts: dict[int, str] | None = None,
    ) -> None:
        self.token_texts = [byte_text(b or b"") for b in vocabulary]
        self.marker_texts = list(self.token_texts)  # what the output spells while a marker is awaited
        for token_id, text in (special_texts or {}).items():
            if token_id < len(self.marker_texts):
                self.marker_texts[token_id] = byte_text(text.encode())
        self.trie = _trie((i, self.token_texts[i]) for i, b in enumerate(vocabulary) if b)
        # special tokens a grammar that reads them may take whole, by their text (a stop token
        # only ever where the output may end)
        self.special = [(i, self.marker_texts[i]) for i in (special_texts or {})
                        if i < len(self.marker_texts) and i not in stop_ids]
        self.stop_mask = _mask(len(self.token_texts), (i for i in stop_ids if i < len(self.token_texts)))
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[Hashable, Hashable], bytes] = OrderedDict()

    def allowed(self, guided: GuidedState) -> bytes:
        """The tokens that may come next: those that keep the output valid, and the stop
        tokens where the output may end."""
        if guided.state is None:
            return self.stop_mask
        key = (guided.grammar.key, guided.state)
        mask = self._cache.get(key)
        if mask is None:
            mask = self._cache[key] = self._compute(guided.grammar, guided.state)
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return mask

    def _compute(self, grammar: Grammar, state: Hashable) -> bytes:
        # Down the vocabulary's trie: a first character or two the grammar refuses rule out
        # every token that begins so at once, and tokens that begin alike share those steps.
        ids: list[int] = []
        pending = [(self.trie, state)]
        while pending:
            (children, ends, tails), at = pending.pop()
            ids.extend(ends)
            ids.extend(token_id for token_id, rest in tails if grammar.advance(at, rest) is not None)
            for char, child in children.items():
                nxt = grammar.advance(at, char)
                if nxt is not None:
                    pending.append((child, nxt))
        if getattr(grammar, "reads_special_tokens", False):
            ids.extend(i for i, text in self.special if grammar.advance(state, text) is not None)
        mask = bytearray(_mask(len(self.token_texts), ids))
        # Complete, or stuck: no token spells what must come next (a character the tokenizer
        # only has in pieces). Ending beats sampling from a distribution with nothing in it.
        if grammar.is_complete(state) or not ids:
            for i, stop in enumerate(self.stop_mask):
                mask[i] |= stop
        return bytes(mask)

    def ahead(self, guided: GuidedState, output_token_ids: Sequence[int]) -> GuidedState:
        """The state after the output tokens it has not consumed, `guided` left as it is (a
        row that assumes guessed tokens)."""
        state = replace(guided)
        self.advance(state, output_token_ids)
        return state

    def advance(self, guided: GuidedState, output_token_ids: Sequence[int]) -> None:
        """Consume the output tokens not seen yet (one per step; all of them for a resumed
        request). A token the grammar cannot take (a stop token at the end) leaves the state."""
        texts = self.marker_texts if getattr(guided.grammar, "reads_special_tokens", False) else self.token_texts
        for token_id in output_token_ids[guided.num_tokens :]:
            text = texts[token_id]
            if guided.after is not None:
                text = _past(guided, self.marker_texts[token_id])
                if not text:
                    continue
                if guided.state is not None:  # the grammar's first text: it must fit
                    guided.state = guided.grammar.advance(guided.state, text)
                continue
            nxt = None if guided.state is None else guided.grammar.advance(guided.state, text)
            if nxt is not None:
                guided.state = nxt
        guided.num_tokens = len(output_token_ids)


def _past(guided: GuidedState, text: str) -> str:
    """While waiting for `guided.after`: the text past it once it has come (the grammar
    starts there), else "" and the tail that may begin it is kept."""
    assert guided.after is not None
    seen = guided.seen + text
    at = seen.find(guided.after)
    if at < 0:
        keep = len(guided.after) - 1
        guided.seen = seen[-keep:] if keep else ""
        return ""
    rest = seen[at + len(guided.after):]
    guided.after, guided.seen = None, ""
    return rest


# The vocabulary's trie branches on a token's first TRIE_DEPTH characters; a longer token's rest
# hangs from that node and is stepped whole, where a grammar's whole-text fast path (plain text
# inside a string) serves it. Deeper tries stepped more characters one by one for no gain.
TRIE_DEPTH = 2
Trie = tuple[dict[str, "Trie"], list[int], list[tuple[int, str]]]  # (next characters, tokens ending here, tails)


def _trie(tokens: Iterable[tuple[int, str]]) -> Trie:
    root: Trie = ({}, [], [])
    for token_id, text in tokens:
        node = root
        for char in text[:TRIE_DEPTH]:
            node = node[0].setdefault(char, ({}, [], []))
        if len(text) > TRIE_DEPTH:
            node[2].append((token_id, text[TRIE_DEPTH:]))
        else:
            node[1].append(token_id)
    return root


def _mask(size: int, ids: Iterable[int]) -> bytes:
    mask = bytearray(size)
    for i in ids:
        mask[i] = 1
    return bytes(mask)


class GuidedDecoding:
    """The grammar state of each guided request of one engine, and the masks for a step."""

    def __init__(self, tokenizer: Any, stop_ids: Collection[int]) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.states: dict[str, GuidedState] = {}  # request id -> its progress
        self._masks: TokenMasks | None = None  # built at the first guided request

    def add(self, request_id: str, guided_decoding: dict[str, Any]) -> None:
        grammar = make_grammar(guided_decoding)
        after = guided_decoding.get("after")
        self.states[request_id] = GuidedState(
            grammar, grammar.initial(), after=None if after is None else byte_text(after.encode())
        )

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def masks(self, rows: Sequence[tuple[str, Sequence[int], int]]) -> list[bytes | None] | None:
        """Per row (request id, its output tokens, how many of them at the end are guesses
        (speculative decoding)): the tokens it may sample next, or None for an unguided
        request; None altogether when no row is guided. The request's state takes in its
        tokens, not the guesses."""
        if not any(request_id in self.states for request_id, _, _ in rows):
            return None
        masks = self._token_masks()
        out: list[bytes | None] = []
        for request_id, output_token_ids, num_guessed in rows:
            guided = self.states.get(request_id)
            if guided is not None:
                masks.advance(guided, output_token_ids[: len(output_token_ids) - num_guessed])
                if num_guessed:
                    guided = masks.ahead(guided, output_token_ids)
            if guided is None or guided.after is not None:  # unguided, or not guided yet
                out.append(None)
            else:
                out.append(masks.allowed(guided))
        return out

    def fitting(self, request_id: str, output_token_ids: Sequence[int], guesses: list[int]) -> list[int]:
        """The guesses up to the first one the request's grammar refuses after its output
        (all of them for an unguided request): a refused guess could never be kept."""
        guided = self.states.get(request_id)
        if guided is None or not guesses:
            return guesses
        masks = self._token_masks()
        state = masks.ahead(guided, output_token_ids)
        for i, token_id in enumerate(guesses):
            if state.after is None and not masks.allowed(state)[token_id]:
                return guesses[:i]
            masks.advance(state, [*output_token_ids, *guesses[: i + 1]])
        return guesses

    def _token_masks(self) -> TokenMasks:
        if self._masks is None:  # every token's bytes, once (a fraction of a second)
            self._masks = TokenMasks(token_bytes(self.tokenizer), self.stop_ids,
                                     special_texts=special_texts(self.tokenizer))
        return self._masks
