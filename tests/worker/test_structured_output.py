"""Guided decoding's masks (worker.guided.structured_output, on xgrammar) on the default
vocabulary: at each state along an output, a token is allowed exactly when the output with
its text may still become a sentence of the grammar (xgrammar's string matcher, which knows
no vocabulary, is the oracle); stop tokens only where the output may end; special tokens
never in a grammar's text but where a structural tag reads them; rows not guided (yet) free;
a grammar that waits for a marker; speculative guesses' rows."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
import xgrammar as xgr

from worker.guided.structured_output import GuidedDecoding, structural_tag_json
from worker.sample.sampling_batch import unpack_bitmask

SCHEMA = {"type": "object", "required": ["name", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 12}, "size": {"anyOf": [{"type": "integer"}, {"enum": ["big", "small"]}]},
    "tags": {"type": "array", "items": {"enum": ["red", "reed", "blue"]}, "maxItems": 3}}}
QUERY = {"type": "object", "required": ["q"], "properties": {"q": {"type": "string"}}}
# a trigger, begin and end that are special tokens of the default vocabulary
SPECIAL_TAG = {"structures": [{"begin": "<repo_name>", "schema": QUERY, "end": "<file_sep>"}], "triggers": ["<repo_name>"]}
SAMPLED = 400  # tokens checked against the oracle at each state (besides every allowed one's count)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def guided(tokenizer) -> GuidedDecoding:
    return GuidedDecoding(tokenizer, {tokenizer.eos_token_id}, len(tokenizer))


def allowed(guided: GuidedDecoding, request_id: str, output: list[int], num_guessed: int = 0) -> set[int]:
    bitmask = guided.masks([(request_id, output, num_guessed)])
    assert bitmask is not None
    return set(torch.nonzero(unpack_bitmask(bitmask, guided.vocab_size)[0]).flatten().tolist())


def oracle(guided_decoding: dict) -> xgr.CompiledGrammar:
    """The grammar over text alone (no vocabulary): what may follow is judged by the string."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]))
    if "structural_tag" in guided_decoding:
        return compiler.compile_structural_tag(structural_tag_json(guided_decoding["structural_tag"]))
    if "json_schema" in guided_decoding:
        return compiler.compile_json_schema(guided_decoding["json_schema"])
    if "regex" in guided_decoding:
        return compiler.compile_regex(guided_decoding["regex"])
    return compiler.compile_grammar(guided_decoding["grammar"])


def takes(compiled: xgr.CompiledGrammar, text: bytes) -> bool:
    return xgr.GrammarMatcher(compiled).accept_string(text)


def complete(compiled: xgr.CompiledGrammar, text: bytes) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize(("guided_decoding", "text"), [
    ({"json_schema": SCHEMA}, '{"name": "Ann", "size": "big", "tags": ["reed"]}'),
    ({"regex": r"(yes|no|maybe)[0-9]{1,3}!?"}, "maybe42!"),
    ({"grammar": 'root ::= "SELECT " [a-z_]+ (", " [a-z_]+)* " FROM " [a-z]+ ";"'}, "SELECT name, age FROM people;"),
    ({"structural_tag": SPECIAL_TAG}, 'Looking: <repo_name>{"q": "genq"}<file_sep> done'),
], ids=["json_schema", "regex", "grammar", "special-token structural tag"])
def test_masks_allow_the_tokens_whose_text_fits_the_grammar(tokenizer, guided, guided_decoding, text) -> None:
    compiled, texts = oracle(guided_decoding), guided._texts()
    specials = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} - {tokenizer.eos_token_id}
    reads_special = "structural_tag" in guided_decoding
    output = tokenizer.encode(text, add_special_tokens=False)
    assert reads_special == bool(specials & set(output))
    request_id = f"r{len(guided.states)}"
    guided.add(request_id, guided.compile(guided_decoding))
    rng = random.Random(5)
    for n in range(len(output) + 1):
        mask, prefix = allowed(guided, request_id, output[:n]), b"".join(texts[t] for t in output[:n])
        assert n == len(output) or output[n] in mask
        assert (tokenizer.eos_token_id in mask) == complete(compiled, prefix)  # it may end only when complete
        if not reads_special:
            assert not mask & specials
        for token_id in rng.sample(range(len(tokenizer)), SAMPLED):
            if token_id == tokenizer.eos_token_id or (token_id in specials and not reads_special):
                continue
            assert (token_id in mask) == takes(compiled, prefix + texts[token_id]), (n, texts[token_id])
    guided.remove(request_id)


def test_rows_not_guided_are_free_and_no_guided_row_means_no_mask(tokenizer, guided) -> None:
    guided.add("g", guided.compile({"choice": ["yes", "no"]}))
    bitmask = guided.masks([("free", [5, 6], 0), ("g", [], 0)])
    assert bitmask is not None and bool(bitmask[0].eq(-1).all())
    assert guided.masks([("free", [5, 6], 0)]) is None
    guided.remove("g")


def test_a_grammar_that_starts_after_a_marker(tokenizer, guided) -> None:
    """A reasoning model thinks freely until "</think>"; the grammar holds from there on,
    whether the marker comes in pieces or shares a token with what follows it; a text after
    it that no sentence begins with leaves the output only its stop tokens."""
    yes_or_no = {"choice": ["yes", "no"], "after": "</think>"}
    guided.add("m", guided.compile(yes_or_no))
    thinking = tokenizer.encode("hm, </think", add_special_tokens=False)
    assert guided.masks([("m", thinking, 0)]).eq(-1).all()  # still thinking
    answer = tokenizer.encode("hm, </think>", add_special_tokens=False)
    assert tokenizer.encode("yes", add_special_tokens=False)[0] in allowed(guided, "m", answer)
    # the token "think" ends the marker "</thi" and writes the answer "nk" too
    guided.add("joined", guided.compile({"choice": ["nk", "no"], "after": "</thi"}))
    assert allowed(guided, "joined", thinking) == {tokenizer.eos_token_id}  # complete: it may only stop
    guided.add("broken", guided.compile({"choice": ["yes", "no"], "after": "</th"}))  # "ink" follows it
    assert allowed(guided, "broken", thinking) == {tokenizer.eos_token_id}
    for request_id in ("m", "joined", "broken"):
        guided.remove(request_id)


def test_a_marker_of_special_tokens(tokenizer, guided) -> None:
    """gpt-oss's answer opens with special tokens: they spell the marker the grammar waits
    for (here the default vocabulary's <repo_name>...<file_sep>)."""
    guided.add("s", guided.compile({"choice": ["yes", "no"], "after": "<repo_name>final<file_sep>"}))
    ids = tokenizer.convert_tokens_to_ids
    thinking = [ids("<repo_name>"), *tokenizer.encode("analysis", add_special_tokens=False), ids("<file_sep>"),
                ids("<repo_name>"), *tokenizer.encode("final", add_special_tokens=False)]
    assert guided.masks([("s", thinking, 0)]).eq(-1).all()  # the final channel has not opened yet
    yes, no = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("yes", "no"))
    assert {yes, no} <= allowed(guided, "s", [*thinking, ids("<file_sep>")])
    guided.remove("s")


def test_guess_rows_are_masked_as_if_the_guesses_were_output(tokenizer, guided) -> None:
    """Row j of a request with guesses is masked as a request whose output ends with the
    first j guesses; the request's own matcher takes in its output only."""
    spec = {"json_schema": SCHEMA}
    output = tokenizer.encode('{"name": "Ann", "tags": ["re', add_special_tokens=False)
    guesses = tokenizer.encode('ed"]}', add_special_tokens=False)
    guided.add("spec", guided.compile(spec))
    rows = [("spec", output + guesses[:j], j) for j in range(len(guesses) + 1)]
    bitmask = guided.masks(rows)
    for j in range(len(guesses) + 1):
        guided.add(f"plain{j}", guided.compile(spec))
        assert torch.equal(bitmask[j], guided.masks([(f"plain{j}", output + guesses[:j], 0)])[0]), j
        guided.remove(f"plain{j}")
    assert torch.equal(guided.masks([("spec", output, 0)])[0], bitmask[0])  # (the guesses were given back)
    assert guided.fitting("spec", output, [*guesses, *tokenizer.encode("x", add_special_tokens=False)]) == guesses
    guided.remove("spec")


def test_tokens_past_the_tokenizers_vocabulary_are_never_allowed(tokenizer) -> None:
    padded = GuidedDecoding(tokenizer, {tokenizer.eos_token_id}, len(tokenizer) + 64)  # (a padded LM head)
    padded.add("p", padded.compile({"json_object": True}))
    mask = unpack_bitmask(padded.masks([("p", [], 0)]), padded.vocab_size)[0]
    assert mask[: len(tokenizer)].any() and not mask[len(tokenizer):].any()


@pytest.mark.parametrize(("schema", "breaking"), [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ({"type": "string", "not": {"const": "a"}}, '"a"'),
    ({"type": "object", "properties": {"c": {"type": "string"}, "z": {"type": "string"}},
      "if": {"properties": {"c": {"const": "US"}}}, "then": {"properties": {"z": {"pattern": "^[0-9]+$"}}}},
     '{"c": "US", "z": "x"}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]"),
    ({"allOf": [{"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
                {"properties": {"n": {"type": "string"}}}]}, '{"n": "a"}'),
    ({"type": "number", "multipleOf": 0.5}, "0.3"),
    ({"type": "number", "multipleOf": 5}, "7"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, '"aaaaa"'),
    ({"type": "string", "format": "email", "maxLength": 5}, '"abc@def.com"'),
    ({"type": "string", "pattern": "^(?!rpc[.])[a-z.]+$"}, '"rpc.x"'),
], ids=["uniqueItems", "not", "if-then", "dependentRequired", "contains", "allOf", "multipleOf 0.5", "multipleOf 5 on a number",
        "maxLength beside pattern", "maxLength beside format", "lookahead"])
def test_the_keywords_refused_before_a_job_is_queued_are_those_xgrammar_does_not_hold(schema, breaking) -> None:
    """producer.grammar.json_schema refuses these keywords: xgrammar takes a text that breaks
    each (the day it holds one, this fails and the keyword may come off the list)."""
    from producer.grammar.json_schema import check_enforceable

    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_json_schema(schema, any_whitespace=False))
    assert matcher.accept_string(breaking) and matcher.is_completed()
    with pytest.raises(ValueError, match="is not supported"):
        check_enforceable(schema)


@pytest.mark.parametrize(("schema", "validator", "texts"), [
    ({"type": "array", "minItems": 2}, jsonschema.Draft202012Validator, ['[1, "a"]', "[1]", "[]", "[true, null, 3]"]),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "object", "required": ["x"],
      "properties": {"x": {"type": "number", "minimum": 3, "exclusiveMinimum": True, "maximum": 9}}},
     jsonschema.Draft4Validator, ['{"x": 3}', '{"x": 3.5}', '{"x": 2}', '{"x": 9}', '{"x": 10}']),
], ids=["minItems without items", "draft 4's boolean exclusiveMinimum"])
def test_schemas_xgrammar_misreads_are_followed_as_json_schema_means(tokenizer, guided, schema, validator, texts) -> None:
    """xgrammar refuses these as written (the day it reads them, this fails and
    producer.grammar.json_schema.for_xgrammar may go); the worker takes them, and a text is
    taken whole exactly when `jsonschema` says it is valid."""
    with pytest.raises(RuntimeError):
        xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_json_schema(schema)
    for i, text in enumerate(texts):
        request_id = f"misread{i}"
        guided.add(request_id, guided.compile({"json_schema": schema}))
        output = tokenizer.encode(text, add_special_tokens=False)
        taken = all(output[n] in allowed(guided, request_id, output[:n]) for n in range(len(output)))
        taken = taken and tokenizer.eos_token_id in allowed(guided, request_id, output)
        guided.remove(request_id)
        assert taken == validator(schema).is_valid(json.loads(text)), text
