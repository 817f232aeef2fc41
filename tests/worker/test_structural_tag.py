"""Structural tags (vLLM's `structural_tag`) against xgrammar, the backend vLLM hands them to:
the same bytes taken and refused, the same places the output may end, and the same token masks
on the default vocabulary, special tokens taken by their text as xgrammar takes them
(whitespace past genq's cap aside)."""

from __future__ import annotations

import json
import random

import pytest
import xgrammar as xgr
from test_structured_output import check_masks_against_xgrammar, grammar_takes, xgrammar_takes

from producer.grammar.structural_tag import read_structural_tag
from worker.guided.json_grammar import MAX_WHITESPACE_RUN
from worker.guided.structural_tag import StructuralTagGrammar
from worker.guided.token_bytes import special_texts, token_bytes

WEATHER = {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"enum": ["C", "F"]}}}
SEARCH = {"type": "object", "required": ["q"], "properties": {"q": {"type": "string", "maxLength": 20}}}
SPEC = {"structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
                       {"begin": "<function=search>", "schema": SEARCH, "end": "</function>"},
                       {"begin": "[[note]]", "schema": {"type": "object"}, "end": ""}],
        "triggers": ["<function=", "[["]}
ANY = {"type": "object"}
PROSE = ["Sure.", " Let me check", "<b>bold</b>", " a < b,", " [link](x)", "\n", " é 日本 🙂", "<func", "[note"]


def xgrammar_tag(spec: dict) -> xgr.Grammar:
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
             for s in spec["structures"]]
    return xgr.Grammar.from_structural_tag(items, spec["triggers"])


def call(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        args = {"city": rng.choice(["Paris", "Tōkyō", 'say "hi"']), "days": rng.randint(1, 14)}
        if rng.random() < 0.5:
            args["unit"] = rng.choice("CF")
        return f"<function=get_weather>{json.dumps(args, ensure_ascii=rng.random() < 0.5)}</function>"
    if kind == 1:
        return f'<function=search>{json.dumps({"q": rng.choice(["genq", "a b c", ""])})}</function>'
    return f"[[note]]{json.dumps({'any': [1, {'x': None}]}, separators=(',', ':'))}"


def text(rng: random.Random) -> str:
    return "".join(rng.choice(PROSE) if rng.random() < 0.6 else call(rng) for _ in range(rng.randint(1, 5)))


def mutated(value: str, rng: random.Random) -> str:
    chars = list(value)
    at = rng.randrange(len(chars) + 1)
    if rng.random() < 0.5 and at < len(chars):
        del chars[at]
    else:
        chars.insert(at, rng.choice('<>[]{}":, 1xé'))
    return "".join(chars)


def test_texts_are_taken_and_refused_as_xgrammar_does() -> None:
    grammar, compiled = StructuralTagGrammar(SPEC), xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(xgrammar_tag(SPEC))
    rng = random.Random(3)
    texts = [text(rng) for _ in range(60)]
    texts += [mutated(t, rng) for t in texts for _ in range(4)]
    refused = 0
    for value in texts:
        verdict = grammar_takes(grammar, value)
        assert verdict == xgrammar_takes(compiled, value), value
        refused += verdict[0] < len(value.encode())
    assert 60 <= refused < len(texts) - 60  # the changes broke many calls, not all


# a trigger, begin and end that are special tokens of the default vocabulary, taken whole
QUERY = {"type": "object", "required": ["q"], "properties": {"q": {"type": "string"}}}
SPECIAL_SPEC = {"structures": [{"begin": "<repo_name>", "schema": QUERY, "end": "<file_sep>"}],
                "triggers": ["<repo_name>"]}


@pytest.mark.parametrize("spec, reply", [
    (SPEC, 'I will look. <function=get_weather>{"city": "Nice", "days": 2}</function> Then [[note]]{}'),
    (SPECIAL_SPEC, 'Looking: <repo_name>{"q": "genq"}<file_sep> done <repo_name>{"q": ""}<file_sep>'),
], ids=["text tags", "special-token tags"])
def test_masks_on_the_default_vocabulary_equal_xgrammars(default_model_dir, spec: dict, reply: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    vocabulary = token_bytes(tokenizer)
    specials = set(special_texts(tokenizer))
    assert (sum(t in specials for t in tokenizer.encode(reply, add_special_tokens=False)) == 4) == (spec is SPECIAL_SPEC)
    # genq's JSON takes at most MAX_WHITESPACE_RUN whitespace in a row (no padding forever)
    padding = {i for i, data in enumerate(vocabulary) if data and not data.strip() and len(data) >= MAX_WHITESPACE_RUN}
    check_masks_against_xgrammar(tokenizer, lambda compiler: compiler.compile_grammar(xgrammar_tag(spec)),
                                 {"structural_tag": spec}, reply, padding, with_special_tokens=True)


@pytest.mark.parametrize("spec, message", [
    ({"structures": [], "triggers": ["<f"]}, "structures must be a non-empty list"),
    ({"structures": [{"begin": "<f>", "schema": {}}], "triggers": []}, "triggers must be a non-empty list"),
    ({"structures": [{"begin": "<g>", "schema": {"type": "object"}}], "triggers": ["<f"]}, "starts with none of the triggers"),
    ({"structures": [{"begin": "<f>", "schema": {"type": "object"}}], "triggers": ["<f", "<g"]}, "trigger '<g' begins none"),
    ({"structures": [{"begin": "<f", "schema": ANY}, {"begin": "<f>", "schema": ANY}], "triggers": ["<f"]},
     "cannot be told apart"),
    ({"structures": [{"begin": "<fa>", "schema": ANY}], "triggers": ["<f", "<fa"]}, "begins with another trigger"),
    ({"structures": [{"begin": "<f>", "schema": {"type": "object", "properties": {"a": {"multipleOf": 2}}}}],
      "triggers": ["<f"]}, "structures[0] json_schema: #/properties/a"),
    ({"structures": [{"begin": "<f>", "schema": {}, "stop": "x"}], "triggers": ["<f"]}, "begin, schema and end"),
    ({"format": {"type": "const_string", "value": "x"}}, "'format' form is not supported"),
    ("{not json", "must be a JSON object or its text"),
])
def test_bad_structural_tags_are_refused_naming_what(spec, message: str) -> None:
    with pytest.raises(ValueError, match="structural_tag") as info:
        read_structural_tag(spec)
    assert message in str(info.value)
