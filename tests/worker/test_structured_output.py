"""Guided decoding's choice grammar and token masks (the JSON grammars: test_json_grammar)."""

from __future__ import annotations

from worker.json_grammar import JSON_OBJECT
from worker.structured_output import ChoiceGrammar, GuidedState, TokenMasks


def test_choice_grammar() -> None:
    grammar = ChoiceGrammar(["yes", "no", "not sure"])
    start = grammar.initial()
    assert grammar.advance(start, "no") == "no" and grammar.is_complete("no")
    assert grammar.advance(grammar.advance(start, "n"), "ot") == "not" and not grammar.is_complete("not")
    assert grammar.advance(start, "nope") is None and grammar.advance(start, "maybe") is None


def test_token_masks_follow_the_grammar_and_end_with_the_stop_tokens() -> None:
    vocab = ["{", "}", '"', "a", '"a"', ":", "1", " ", "<eos>", "\ufffd", "},", '{"']
    masks = TokenMasks(vocab, special_ids={8}, stop_ids={8})

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
    masks = TokenMasks(["a", "b", "c"], special_ids=set(), stop_ids=set(), cache_size=2)
    grammars = [ChoiceGrammar([word]) for word in ("a", "b", "c")]
    for grammar in grammars:
        masks.allowed(GuidedState(grammar, grammar.initial()))
    assert len(masks._cache) == 2


def test_a_complete_choice_that_another_extends_may_stop_or_go_on() -> None:
    vocab = ["no", "t", " sure", "<eos>", "yes"]
    masks = TokenMasks(vocab, special_ids={3}, stop_ids={3})
    grammar = ChoiceGrammar(["no", "not sure", "yes"])
    guided = GuidedState(grammar, grammar.initial())
    assert [vocab[i] for i, ok in enumerate(masks.allowed(guided)) if ok] == ["no", "yes"]
    masks.advance(guided, [0])
    assert [vocab[i] for i, ok in enumerate(masks.allowed(guided)) if ok] == ["t", "<eos>"]
    masks.advance(guided, [0, 1])
    assert [vocab[i] for i, ok in enumerate(masks.allowed(guided)) if ok] == [" sure"]


def test_a_state_no_token_can_continue_allows_only_the_stop_tokens() -> None:
    vocab = ["a", "\ufffd", "<eos>"]  # "é" exists only in byte pieces
    masks = TokenMasks(vocab, special_ids={2}, stop_ids={2})
    grammar = ChoiceGrammar(["é"])
    assert list(masks.allowed(GuidedState(grammar, grammar.initial()))) == [0, 0, 1]
