"""Guided decoding's choice grammar and token masks (the JSON grammars: test_json_grammar)."""

from __future__ import annotations

import json

import pytest

from worker.guided.json_grammar import JSON_OBJECT
from worker.guided.structured_output import ChoiceGrammar, GuidedState, TokenMasks, make_grammar
from worker.guided.token_bytes import byte_text, special_texts, token_bytes


def vocabulary(texts: list[str], special: set[int]) -> list[bytes | None]:
    return [None if i in special else text.encode() for i, text in enumerate(texts)]


def test_choice_grammar() -> None:
    grammar = ChoiceGrammar(["yes", "no", "not sure"])
    start = grammar.initial()
    assert grammar.advance(start, "no") == "no" and grammar.is_complete("no")
    assert grammar.advance(grammar.advance(start, "n"), "ot") == "not" and not grammar.is_complete("not")
    assert grammar.advance(start, "nope") is None and grammar.advance(start, "maybe") is None


def test_token_masks_follow_the_grammar_and_end_with_the_stop_tokens() -> None:
    vocab = ["{", "}", '"', "a", '"a"', ":", "1", " ", "<eos>", "", "},", '{"']
    masks = TokenMasks(vocabulary(vocab, {8}), stop_ids={8})

    def allowed(guided: GuidedState) -> set[str]:
        return {vocab[i] for i, ok in enumerate(masks.allowed(guided)) if ok}

    guided = GuidedState(JSON_OBJECT, JSON_OBJECT.initial())
    assert allowed(guided) == {"{", " ", '{"'}
    output = [vocab.index('{"')]
    masks.advance(guided, output)
    assert allowed(guided) == {'"', "a", ":", "1", " ", "{", "}", "},", '{"'}  # inside a key
    output += [vocab.index("a"), vocab.index('"'), vocab.index(":")]
    masks.advance(guided, output)
    assert allowed(guided) == {'"', '"a"', "1", " ", "{", '{"'}
    output += [vocab.index("1"), vocab.index("}")]
    masks.advance(guided, output)
    assert JSON_OBJECT.is_complete(guided.state) and allowed(guided) == {"<eos>"}
    masks.advance(guided, [*output, 8])  # the stop token itself leaves the state
    assert JSON_OBJECT.is_complete(guided.state) and guided.num_tokens == len(output) + 1
    again = GuidedState(JSON_OBJECT, JSON_OBJECT.initial())
    assert masks.allowed(again) is masks.allowed(GuidedState(JSON_OBJECT, JSON_OBJECT.initial()))  # cached


def test_mask_cache_is_bounded() -> None:
    masks = TokenMasks(vocabulary(["a", "b", "c"], set()), stop_ids=set(), cache_size=2)
    grammars = [ChoiceGrammar([word]) for word in ("a", "b", "c")]
    for grammar in grammars:
        masks.allowed(GuidedState(grammar, grammar.initial()))
    assert len(masks._cache) == 2


def test_a_complete_choice_that_another_extends_may_stop_or_go_on() -> None:
    vocab = ["no", "t", " sure", "<eos>", "yes"]
    masks = TokenMasks(vocabulary(vocab, {3}), stop_ids={3})
    grammar = ChoiceGrammar(["no", "not sure", "yes"])
    guided = GuidedState(grammar, grammar.initial())
    assert [vocab[i] for i, ok in enumerate(masks.allowed(guided)) if ok] == ["no", "yes"]
    masks.advance(guided, [0])
    assert [vocab[i] for i, ok in enumerate(masks.allowed(guided)) if ok] == ["t", "<eos>"]
    masks.advance(guided, [0, 1])
    assert [vocab[i] for i, ok in enumerate(masks.allowed(guided)) if ok] == [" sure"]


def test_a_state_no_token_can_continue_allows_only_the_stop_tokens() -> None:
    masks = TokenMasks([b"a", b"b", None], stop_ids={2})
    grammar = ChoiceGrammar(["c"])
    assert list(masks.allowed(GuidedState(grammar, grammar.initial()))) == [0, 0, 1]


def test_a_character_the_vocabulary_has_only_in_byte_pieces_can_be_written() -> None:
    """"日" is three bytes; here no token holds it whole (as in byte-level vocabularies that
    rarely saw it), yet guided output may spell it from its pieces."""
    pieces = ["日".encode()[:1], "日".encode()[1:], "本".encode(), b"x", None]
    masks = TokenMasks(pieces, stop_ids={4})
    grammar = ChoiceGrammar(["日本"])
    guided = GuidedState(grammar, grammar.initial())
    assert list(masks.allowed(guided)) == [1, 0, 0, 0, 0]
    masks.advance(guided, [0])
    assert list(masks.allowed(guided)) == [0, 1, 0, 0, 0]
    masks.advance(guided, [0, 1, 2])
    assert grammar.is_complete(guided.state) and list(masks.allowed(guided)) == [0, 0, 0, 0, 1]


def test_a_grammar_that_starts_after_a_marker() -> None:
    """A reasoning model thinks freely until "</think>"; the grammar holds from there on,
    whether the marker comes in pieces or shares a token with what follows it."""
    vocab = ["</", "think", ">", "</think>", "yes", "no", "hm", "<eos>", "x", "</think>yes"]
    masks = TokenMasks(vocabulary(vocab, {7}), stop_ids={7})
    guided = GuidedState(ChoiceGrammar(["yes", "no"]), "", after="</think>")

    def allowed() -> set[str]:
        return {vocab[i] for i, ok in enumerate(masks.allowed(guided)) if ok}

    output = [vocab.index(t) for t in ("hm", "</", "think")]
    masks.advance(guided, output)
    assert guided.after == "</think>" and guided.seen == "</think"  # still thinking
    masks.advance(guided, [*output, vocab.index(">")])
    assert guided.after is None and allowed() == {"yes", "no"}
    masks.advance(guided, [*output, vocab.index(">"), vocab.index("no")])
    assert allowed() == {"<eos>"}
    joined = GuidedState(ChoiceGrammar(["yes", "no"]), "", after="</think>")
    masks.advance(joined, [vocab.index("</think>yes")])  # the grammar's first text came with it
    assert joined.state == "yes"
    broken = GuidedState(ChoiceGrammar(["yes", "no"]), "", after="</th")  # "ink" follows it
    masks.advance(broken, [vocab.index("</"), vocab.index("think")])
    assert broken.state is None and list(masks.allowed(broken)) == [0] * 7 + [1, 0, 0]  # it may only stop


def test_a_marker_of_special_tokens() -> None:
    """gpt-oss's answer opens with special tokens (`<|channel|>final<|message|>`): they spell
    the marker the grammar waits for, and are never allowed inside the guided output."""
    vocab = ["<|channel|>", "<|message|>", "analysis", "final", "yes", "no", "<eos>", "hm"]
    masks = TokenMasks(vocabulary(vocab, {0, 1, 6}), stop_ids={6}, special_texts={0: "<|channel|>", 1: "<|message|>"})
    guided = GuidedState(ChoiceGrammar(["yes", "no"]), "", after="<|channel|>final<|message|>")
    thinking = [vocab.index(t) for t in ("<|channel|>", "analysis", "<|message|>", "hm", "<|channel|>", "final")]
    masks.advance(guided, thinking)
    assert guided.after is not None  # the analysis channel is free; the final one has not opened yet
    masks.advance(guided, [*thinking, vocab.index("<|message|>")])
    assert guided.after is None
    assert {vocab[i] for i, ok in enumerate(masks.allowed(guided)) if ok} == {"yes", "no"}


SCHEMA = {"type": "object", "required": ["name", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 12}, "size": {"anyOf": [{"type": "integer"}, {"enum": ["big", "small"]}]},
    "tags": {"type": "array", "items": {"enum": ["red", "reed", "blue"]}, "maxItems": 3}}}


@pytest.mark.parametrize(("guided_decoding", "text"), [
    ({"json_object": True}, '{"a": [-2.5e3, true], "b\\u00e9": {"c": "d"}}'),
    ({"json_schema": SCHEMA}, '{"name": "Ann", "size": "big", "tags": ["reed"]}'),
    ({"regex": r"(yes|no|maybe)[0-9]{1,3}!?"}, "maybe42!"),
    ({"choice": ["set it", "set them", "leave it"]}, "set them"),
    ({"grammar": 'root ::= "SELECT " [a-z_]+ (", " [a-z_]+)* " FROM " [a-z]+ ";"'}, "SELECT name, age FROM people;"),
], ids=["json_object", "json_schema", "regex", "choice", "grammar"])
def test_masks_on_the_default_vocabulary_equal_checking_every_token(default_model_dir, guided_decoding, text) -> None:
    """The masks, found down the vocabulary's trie, allow exactly the tokens that the grammar
    takes whole, at each state along an output that the tokenizer splits as it would."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    vocabulary = token_bytes(tokenizer)
    masks = TokenMasks(vocabulary, stop_ids={tokenizer.eos_token_id})
    grammar = make_grammar(guided_decoding)
    guided = GuidedState(grammar, grammar.initial())
    output = tokenizer.encode(text, add_special_tokens=False)
    for steps in range(len(output) + 1):
        masks.advance(guided, output[:steps])
        assert guided.state is not None, tokenizer.decode(output[:steps])
        every = {i for i, data in enumerate(vocabulary) if data and grammar.advance(guided.state, masks.token_texts[i]) is not None}
        allowed = {i for i, ok in enumerate(masks.allowed(guided)) if ok} - {tokenizer.eos_token_id}
        assert allowed == every, (tokenizer.decode(output[:steps]), [masks.token_texts[i] for i in allowed ^ every][:10])
    assert grammar.is_complete(guided.state) and masks.allowed(guided)[tokenizer.eos_token_id]


EBNF_ITEMS = r"""
root ::= "{" ws "\"items\"" ws ":" ws "[" ws (item (ws "," ws item)*)? ws "]" ws "}"
item ::= "\"" [^"\\\n]* "\"" | [0-9]+ ("." [0-9]+)? | "é" | "[" ws (item (ws "," ws item)*)? ws "]"
ws ::= [ \n\t]*
"""


def grammar_takes(grammar, text: str) -> tuple[int, bool]:
    """How many of the text's UTF-8 bytes a grammar takes before refusing one, and whether
    the output may end there."""
    state = grammar.initial()
    for i, char in enumerate(byte_text(text.encode())):
        nxt = grammar.advance(state, char)
        if nxt is None:
            return i, grammar.is_complete(state)
        state = nxt
    return len(text.encode()), grammar.is_complete(state)


def xgrammar_takes(compiled, text: str) -> tuple[int, bool]:
    """The same for an xgrammar compiled grammar, fed a byte at a time."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    for i, byte in enumerate(text.encode()):
        if not matcher.accept_string(bytes([byte])):
            return i, matcher.is_completed()
    return len(text.encode()), matcher.is_completed()


def check_masks_against_xgrammar(tokenizer, compile_for_xgrammar, guided_decoding: dict, text: str,
                                 not_compared: set[int] = frozenset(), with_special_tokens: bool = False) -> None:
    """At each state along `text` as the tokenizer splits it, the tokens genq's mask allows
    are those xgrammar's bitmask allows, the grammar compiled by `compile_for_xgrammar(compiler)`
    (but for `not_compared`; special tokens only where the grammar reads them); both end
    complete."""
    import xgrammar as xgr

    vocabulary = token_bytes(tokenizer)
    masks = TokenMasks(vocabulary, stop_ids={tokenizer.eos_token_id},
                       special_texts=special_texts(tokenizer) if with_special_tokens else None)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(vocabulary))
    matcher = xgr.GrammarMatcher(compile_for_xgrammar(xgr.GrammarCompiler(info)))
    bitmask = xgr.allocate_token_bitmask(1, len(vocabulary))
    if not with_special_tokens:  # genq never lets one stand in such text; xgrammar takes one whose text fits
        not_compared = set(not_compared) | ({i for i, data in enumerate(vocabulary) if data is None} - {tokenizer.eos_token_id})
    grammar = make_grammar(guided_decoding)
    guided = GuidedState(grammar, grammar.initial())
    output = tokenizer.encode(text, add_special_tokens=False)
    for steps in range(len(output) + 1):
        masks.advance(guided, output[:steps])
        matcher.fill_next_token_bitmask(bitmask)
        words = bitmask[0].tolist()
        theirs = {i for i in range(len(vocabulary)) if (words[i // 32] >> (i % 32)) & 1} - not_compared
        allowed = {i for i, ok in enumerate(masks.allowed(guided)) if ok} - not_compared
        assert allowed == theirs, (tokenizer.decode(output[:steps]), [tokenizer.decode([i]) for i in allowed ^ theirs][:10])
        if steps < len(output):
            assert matcher.accept_token(output[steps])
    assert matcher.is_completed() and grammar.is_complete(guided.state)


@pytest.mark.parametrize(("grammar", "text"), [
    (EBNF_ITEMS, '{"items": [12, "two words é", [3.5, é], []]}'),
    ('root ::= "SELECT " column " FROM " ("t1" | "t2") (" WHERE " column "=" [0-9]+)?\n'
     'column ::= "col_" [0-9] | "name"', "SELECT name FROM t2 WHERE col_7=42"),
], ids=["items", "sql"])
def test_grammar_masks_on_the_default_vocabulary_equal_xgrammars(default_model_dir, grammar: str, text: str) -> None:
    """At each state along an output, the tokens an EBNF grammar's mask allows are those
    xgrammar's bitmask allows (vLLM's backend for grammars), special tokens aside."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    check_masks_against_xgrammar(tokenizer, lambda compiler: compiler.compile_grammar(grammar), {"grammar": grammar}, text)


def test_compact_json_masks_on_the_default_vocabulary_equal_xgrammars(default_model_dir) -> None:
    """disable_any_whitespace: at each state of an output, the tokens allowed are those
    xgrammar allows for the schema compiled with any_whitespace=False (special tokens aside)."""
    from transformers import AutoTokenizer

    schema = {"type": "object", "required": ["name", "tags"], "additionalProperties": False, "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "integer"}},
        "extra": {"type": "object"}}}
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    check_masks_against_xgrammar(
        tokenizer, lambda compiler: compiler.compile_json_schema(json.dumps(schema), any_whitespace=False),
        {"json_schema": schema, "disable_any_whitespace": True},
        '{"name": "Ann, \\"A\\"", "tags": [1, 22, 333], "extra": {"k": [true, null]}}')
