"""Grammars and token masks for guided decoding, against Python's `json` as the oracle."""

from __future__ import annotations

import json
import random

import pytest

from worker.structured_output import (
    JSON_OBJECT,
    MAX_WHITESPACE_RUN,
    ChoiceGrammar,
    GuidedState,
    TokenMasks,
)

VALID = [
    "{}",
    '{"a": 1}',
    '{"a":-0.5e+10,"b":[true,false,null],"c":{"d":[]}}',
    '{ "key" : "va\\"l\\\\ue\\n\\u00e9\\/" , "n": [0, -1, 12.75, 3E-2, 1e5] }',
    '{"unicode": "h\u00e9llo \u4e16\u754c", "empty": "", "nested": [[[{}]]]}',
    '{\n  "pretty": [\n    1,\n    2\n  ]\n}',
]
INVALID = [
    "[]", '"a"', "1", "{", '{"a"}', '{"a":}', '{"a":1,}', "{,}", '{"a":01}', '{"a":1.}', '{"a":-}',
    '{"a":tru}', '{"a":truth}', '{"a":"\\x"}', '{"a":"\\u12g4"}', '{"a":"tab\there"}', "{'a':1}",
    '{"a":1}}', '{"a":[1}', '{"a":1} ', '{"a":NaN}', '{"a":1e}', '{"a":.5}', '{"a":+1}',
]


def feed(text: str, grammar=JSON_OBJECT):
    """The state after `text`, one character at a time; None once rejected."""
    state = grammar.initial()
    for char in text:
        state = grammar.advance(state, char)
        if state is None:
            return None
    return state


@pytest.mark.parametrize("text", VALID)
def test_valid_objects_are_accepted_at_every_prefix_and_complete_only_at_the_end(text: str) -> None:
    assert isinstance(json.loads(text), dict)
    state = JSON_OBJECT.initial()
    for i, char in enumerate(text):
        assert not JSON_OBJECT.is_complete(state), text[:i]
        state = JSON_OBJECT.advance(state, char)
        assert state is not None, f"rejected at {i}: {text[: i + 1]!r}"
    assert JSON_OBJECT.is_complete(state)
    # any split into pieces (tokens) reaches the same state
    rng = random.Random(text)
    cuts = sorted(rng.sample(range(1, len(text)), min(3, len(text) - 1)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    chunked = JSON_OBJECT.initial()
    for piece in pieces:
        chunked = JSON_OBJECT.advance(chunked, piece)
    assert chunked == state


@pytest.mark.parametrize("text", INVALID)
def test_invalid_text_is_rejected_or_never_completes(text: str) -> None:
    state = feed(text)
    assert state is None or not JSON_OBJECT.is_complete(state)


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-8, 8)
    if kind == "str":
        return "".join(rng.choice('ab "\\\n\t\u00e9\u4e16/') for _ in range(rng.randint(0, 6)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int = 0) -> dict:
    return {f"k{i}{rng.choice(['', ' ', 'é'])}": random_value(rng, depth) for i in range(rng.randint(0, 4))}


def test_json_dumps_of_random_objects_is_accepted_and_mutations_are_sound() -> None:
    rng = random.Random(0)
    alphabet = '{}[]:,"\\ -.0123456789eEtrufalsn\n'
    for _ in range(300):
        text = json.dumps(random_object(rng), ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, 1, 2]))
        state = feed(text)
        assert state is not None and JSON_OBJECT.is_complete(state), text
        # a mutated text the grammar takes whole is an object to json too (never the reverse
        # direction: the grammar is stricter, e.g. about whitespace after the object)
        for _ in range(5):
            i = rng.randrange(len(text))
            mutated = text[:i] + rng.choice(["", rng.choice(alphabet)]) + text[i + rng.randint(0, 1):]
            state = feed(mutated)
            if state is not None and JSON_OBJECT.is_complete(state):
                assert isinstance(json.loads(mutated), dict), mutated


def test_whitespace_runs_are_bounded() -> None:
    assert feed("{" + " " * MAX_WHITESPACE_RUN + "}") is not None
    assert feed("{" + " " * (MAX_WHITESPACE_RUN + 1)) is None
    assert feed('{"a": "' + " " * 100 + '"}') is not None  # inside a string, spaces are text


def test_choice_grammar() -> None:
    grammar = ChoiceGrammar(["yes", "no", "not sure"])
    assert feed("no", grammar) == "no" and grammar.is_complete("no")
    assert feed("not", grammar) is not None and not grammar.is_complete("not")
    assert feed("nope", grammar) is None and feed("maybe", grammar) is None


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
