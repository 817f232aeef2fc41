"""Structural tags (vLLM's `structural_tag`): their shape checked before a job is queued
(producer.grammar.structural_tag), with errors that name what is wrong; vLLM's form run as
the triggered tags xgrammar makes of it, and xgrammar's own form passed on to it."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from producer.grammar.structural_tag import read_structural_tag
from worker.guided.structured_output import structural_tag_json

ANY = {"type": "object"}
WEATHER = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}


@pytest.mark.parametrize("spec, message", [
    ({"structures": [], "triggers": ["<f"]}, "structures must be a non-empty list"),
    ({"structures": [{"begin": "<f>", "schema": {}}], "triggers": []}, "triggers must be a non-empty list"),
    ({"structures": [{"begin": "<g>", "schema": {"type": "object"}}], "triggers": ["<f"]}, "starts with none of the triggers"),
    ({"structures": [{"begin": "<f>", "schema": {"type": "object"}}], "triggers": ["<f", "<g"]}, "trigger '<g' begins none"),
    ({"structures": [{"begin": "<f", "schema": ANY}, {"begin": "<f>", "schema": ANY}], "triggers": ["<f"]},
     "cannot be told apart"),
    ({"structures": [{"begin": "<fa>", "schema": ANY}], "triggers": ["<f", "<fa"]}, "begins with another trigger"),
    ({"structures": [{"begin": "<f>", "schema": "object"}], "triggers": ["<f"]}, "structures[0]: schema must be a JSON schema"),
    ({"structures": [{"begin": "<f>", "schema": {}, "stop": "x"}], "triggers": ["<f"]}, "begin, schema and end"),
    ({"format": ["const_string"]}, "format must be an object"),
    ("{not json", "must be a JSON object or its text"),
])
def test_bad_structural_tags_are_refused_naming_what(spec, message: str) -> None:
    with pytest.raises(ValueError, match="structural_tag") as info:
        read_structural_tag(spec)
    assert message in str(info.value)


def test_both_forms_are_run_by_xgrammar() -> None:
    """vLLM's {structures, triggers} takes free text and, after a trigger, a structure's begin,
    a value of its schema and its end; xgrammar's own {format} is its tree, as given."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]))

    def takes(spec: dict, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(structural_tag_json(spec)))
        return matcher.accept_string(text) and matcher.is_completed()

    vllm_form = {"structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"}],
                 "triggers": ["<function="]}
    assert takes(vllm_form, 'Sure. <function=get_weather>{"city": "Nice"}</function> done')
    assert not takes(vllm_form, 'Sure. <function=get_weather>{"town": "Nice"}</function>')
    assert not takes(vllm_form, "Sure. <function=search>{}</function>")
    own_form = {"format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "}, {"type": "json_schema", "json_schema": WEATHER}]}}
    assert takes(json.loads(json.dumps(own_form)), 'Answer: {"city": "Rome"}')
    assert not takes(own_form, '{"city": "Rome"}')
