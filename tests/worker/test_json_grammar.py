"""The JSON grammars of guided decoding against Python's `json` and `jsonschema` as oracles."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from test_structured_output import grammar_takes, xgrammar_takes

from producer.grammar.json_values import integer_range_regex
from producer.sampling_params import SamplingParams
from worker.guided.json_grammar import JSON_OBJECT, MAX_WHITESPACE_RUN
from worker.guided.json_schema_grammar import JsonSchemaGrammar
from worker.guided.token_bytes import byte_text

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


def as_read(text: str) -> str:
    """Text as the grammars read it: its UTF-8 bytes, one character each."""
    return byte_text(text.encode())


def feed(text: str, grammar=JSON_OBJECT):
    """The state after `text`, one byte at a time; None once rejected."""
    state = grammar.initial()
    for char in as_read(text):
        state = grammar.advance(state, char)
        if state is None:
            return None
    return state


@pytest.mark.parametrize("text", VALID)
def test_valid_objects_are_accepted_at_every_prefix_and_complete_only_at_the_end(text: str) -> None:
    assert isinstance(json.loads(text), dict)
    text = as_read(text)
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


@pytest.mark.parametrize("data", [
    b'{"a": "\x80"}',  # a continuation byte with nothing to continue
    b'{"a": "\xe6\x97"}',  # a character cut short by the closing quote
    b'{"a": "\xc0\x80"}',  # a lead byte no well-formed character has
    b'{"a": "\xf5\x80\x80\x80"}',
    b'{"\xff": 1}',
])
def test_bytes_that_are_not_utf8_are_rejected(data: bytes) -> None:
    with pytest.raises(UnicodeDecodeError):
        data.decode()
    state = JSON_OBJECT.initial()
    for char in byte_text(data):
        state = state and JSON_OBJECT.advance(state, char)
    assert state is None or not JSON_OBJECT.is_complete(state)


def test_a_character_in_pieces_is_taken_piece_by_piece() -> None:
    """Byte-level tokens often hold part of a character: each piece alone is a valid prefix."""
    whole = as_read('{"ké": "日本 🙂"}')
    for size in (1, 2, 3):
        state = JSON_OBJECT.initial()
        for at in range(0, len(whole), size):
            state = JSON_OBJECT.advance(state, whole[at : at + size])
            assert state is not None, whole[: at + size]
        assert JSON_OBJECT.is_complete(state)
    schema = {"type": "object", "properties": {"café": {"enum": ["crème", "brûlée"]}},
              "required": ["café"]}
    grammar = JsonSchemaGrammar(schema)
    assert grammar.is_complete(feed('{"café": "crème"}', grammar))
    assert feed('{"café": "créme"}', grammar) is None
    assert feed('{"cafe": "crème"}', grammar) is None


def test_whitespace_runs_are_bounded() -> None:
    assert feed("{" + " " * MAX_WHITESPACE_RUN + "}") is not None
    assert feed("{" + " " * (MAX_WHITESPACE_RUN + 1)) is None
    assert feed('{"a": "' + " " * 100 + '"}') is not None  # inside a string, spaces are text




# ---------------------------------------------------------------------------------------------
# JSON schema


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "minItems": 1, "maxItems": 2},
        "role": {"const": "admin"},
        "scores": {"type": "array", "items": {"type": "number"}},
        "extra": {"type": "object"},
    },
    "required": ["name", "age", "tags"],
}


@pytest.mark.parametrize("text", [
    '{"name": "Ann", "age": 31, "tags": ["a"]}',
    '{"name":"","age":-0,"email":null,"tags":[3,"b"],"role":"admin","scores":[1.5e-3,-2,0],"extra":{"k":[1,{}]}}',
    '{\n  "name": "B\\u00e9",\n  "age": 7,\n  "tags": [\n    "b"\n  ],\n  "extra": {}\n}',
    '{"name": "x", "age": 1, "email": "e@x", "tags": [3]}',
])
def test_schema_instances_are_accepted_and_valid(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)
    grammar = JsonSchemaGrammar(PERSON)
    state = feed(text, grammar)
    assert state is not None and grammar.is_complete(state)


@pytest.mark.parametrize("text", [
    '{"age": 31, "name": "Ann", "tags": ["a"]}',  # out of schema order
    '{"name": "Ann", "tags": ["a"]}',  # age is required
    '{"name": "Ann", "age": 3.5, "tags": ["a"]}',  # not an integer
    '{"name": "Ann", "age": 3, "tags": []}',  # minItems 1
    '{"name": "Ann", "age": 3, "tags": ["a", "b", 3]}',  # maxItems 2
    '{"name": "Ann", "age": 3, "tags": ["c"]}',  # not in the enum
    '{"name": "Ann", "age": 3, "tags": [33]}',
    '{"name": "Ann", "age": 3, "tags": ["a"], "role": "user"}',
    '{"name": "Ann", "age": 3, "tags": ["a"], "nickname": "A"}',  # no other properties
    '{"name": 5, "age": 3, "tags": ["a"]}',
    '{"name": "Ann", "age": 3, "tags": ["a"], "extra": []}',
    '{"name": "Ann", "age": 3, "tags": ["a"]} ',
])
def test_schema_violations_are_rejected_or_never_complete(text: str) -> None:
    grammar = JsonSchemaGrammar(PERSON)
    state = feed(text, grammar)
    assert state is None or not grammar.is_complete(state)


TAGGED_A = {"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer"}},
            "required": ["kind", "n"], "additionalProperties": False}
TAGGED_B = {"type": "object", "properties": {"kind": {"const": "b"}, "s": {"type": "string"}},
            "required": ["kind"], "additionalProperties": False}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    leaves = [{"type": "string"}, {"type": "number"}, {"type": "integer"}, {"type": "boolean"},
              {"type": "null"}, {"enum": ["x", "yz", 1, 12, True, None]}, {"const": "c"}, {},
              {"anyOf": [{"type": "string"}, {"type": "integer"}]}, {"type": ["object", "null"]},
              # alternatives that begin alike, followed together
              {"anyOf": [{"type": "string"}, {"enum": ["x", 1]}, {"type": "number"}]},
              {"anyOf": [{"type": "array", "items": {"type": "integer"}, "maxItems": 2},
                         {"type": "array", "items": {"type": "string"}, "minItems": 1}]},
              {"anyOf": [TAGGED_A, TAGGED_B]}]
    if depth >= 3 or rng.random() < 0.4:
        return rng.choice(leaves)
    if rng.random() < 0.5:
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low,
                **({"maxItems": low + rng.randint(0, 2)} if rng.random() < 0.5 else {})}
    names = [f"p{i}" for i in range(rng.randint(0, 4))]
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": [n for n in names if rng.random() < 0.5], "additionalProperties": False}


def random_walk(grammar, rng: random.Random, max_chars: int = 400) -> str | None:
    """Write a value character by character, each drawn among those the grammar allows
    (closers favoured, so most walks end): what guided sampling does with tokens."""
    alphabet = '{}[],:"ax1-.e0 \\ntrufalsn' + "p0123yzc"
    state, text = grammar.initial(), ""
    for _ in range(max_chars):
        if grammar.is_complete(state):
            return text
        options = [(c, s) for c in alphabet if (s := grammar.advance(state, c)) is not None]
        if not options:
            return None
        closers = [o for o in options if o[0] in '}]"']
        char, state = rng.choice(closers if closers and rng.random() < 0.3 else options)
        text += char
    return None


def test_random_walks_through_random_schemas_write_valid_instances() -> None:
    rng = random.Random(5)
    written = 0
    for _ in range(150):
        schema = {"type": "object", "properties": {"x": random_schema(rng)}, "required": ["x"]}
        grammar = JsonSchemaGrammar(schema)
        for _ in range(4):
            text = random_walk(grammar, rng)
            if text is None:
                continue
            jsonschema.validate(json.loads(text), schema)  # raises if the grammar let it through wrongly
            written += 1
    assert written > 300  # most walks end; each that did was valid


@pytest.mark.parametrize(("text", "valid"), [
    ('{"x": {"kind": "a", "n": 3}}', True),
    ('{"x": {"kind": "b"}}', True),
    ('{"x": {"kind": "b", "s": "q"}}', True),
    ('{"x": {"kind": "a"}}', False),  # n is required with kind a
    ('{"x": {"kind": "a", "s": "q"}}', False),  # s belongs to kind b
    ('{"x": {"kind": "b", "n": 3}}', False),
    ('{"x": {"kind": "c"}}', False),
])
def test_objects_told_apart_by_a_tag_are_followed_together(text: str, valid: bool) -> None:
    schema = {"type": "object", "properties": {"x": {"anyOf": [TAGGED_A, TAGGED_B]}}, "required": ["x"]}
    grammar = JsonSchemaGrammar(schema)
    state = feed(text, grammar)
    assert (state is not None and grammar.is_complete(state)) == valid
    assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)) == valid
    # one state while the tag is written, however many alternatives: it decides which follows
    assert not isinstance(feed('{"x": {"ki', grammar), frozenset)
    assert not isinstance(feed('{"x": {"kind": "a"', grammar), frozenset)


def test_a_union_of_many_tagged_objects_is_followed_as_one_object() -> None:
    """As tool calls are (`{"name": <const>, "arguments": ...}`): past the cap on alternatives
    followed together, yet exact."""
    variants = [{"type": "object", "required": ["name", "v"], "properties": {
        "name": {"const": f"tool_{i}"}, "v": {"type": "integer"} if i % 2 else {"type": "string"}}}
        for i in range(40)]
    schema = {"type": "array", "items": {"anyOf": [*variants, {"type": "null"}]}, "minItems": 1}  # as Optional[Union]
    grammar = JsonSchemaGrammar(schema)
    for text, valid in [('[{"name": "tool_7", "v": 3}, null, {"name": "tool_12", "v": "x"}]', True),
                        ('[{"name": "tool_7", "v": "x"}]', False), ('[{"name": "tool_40", "v": 1}]', False),
                        ('[{"name": "tool_1"}]', False)]:
        state = feed(text, grammar)
        assert (state is not None and grammar.is_complete(state)) == valid, text
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)) == valid


def test_alternatives_that_stay_alike_are_capped() -> None:
    """anyOf of two arrays of the same: each "[" doubles what must be followed; past the cap
    the text is refused rather than the worker slowing down without bound."""
    schema = {"$defs": {"t": {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/t"}},
                                         {"type": "array", "items": {"$ref": "#/$defs/t"}}]}},
              "$ref": "#/$defs/t"}
    grammar = JsonSchemaGrammar(schema)
    assert grammar.is_complete(feed("[[[]]]", grammar))
    assert feed("[" * 5, grammar) is None  # 32 alternatives


STRINGS = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{2}$"},
        "note": {"type": "string", "pattern": "ok"},  # found anywhere
        "day": {"type": "string", "format": "date"},
        "at": {"type": "string", "format": "date-time"},
        "mail": {"type": "string", "format": "email"},
        "id": {"type": "string", "format": "uuid"},
        "ip": {"type": "string", "format": "ipv4"},
        "name": {"type": "string", "minLength": 2, "maxLength": 4},
        "opt": {"type": ["string", "null"], "pattern": "^x+$"},
    },
    "required": ["code", "note", "day", "at", "mail", "id", "ip", "name", "opt"],
}
CHECKER = jsonschema.Draft202012Validator(STRINGS, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


@pytest.mark.parametrize(("fields", "valid"), [
    ({}, True),
    ({"note": "so ok then", "name": "日本", "opt": None}, True),
    ({"code": "AB-12"}, False), ({"code": "ABC-123"}, False), ({"note": "nope"}, False),
    ({"day": "2024-13-01"}, False), ({"at": "2024-01-01 10:00:00Z"}, False), ({"mail": "a b@c.org"}, False),
    ({"id": "123"}, False), ({"ip": "256.1.1.1"}, False), ({"name": "a"}, False), ({"name": "abcde"}, False),
    ({"opt": "xy"}, False), ({"note": 'ok "quoted"'}, False),  # valid, but a string under a pattern has no escapes
])
def test_string_patterns_formats_and_lengths(fields: dict, valid: bool) -> None:
    """What the grammar accepts, jsonschema (with its format checker: date, email, uuid,
    ipv4; not date-time) accepts too."""
    instance = {"code": "ABC-12", "note": "ok", "day": "2024-02-29", "at": "2024-02-29T23:59:59.5+01:00",
                "mail": "ann.lee@mail.example.org", "id": "123e4567-e89b-12d3-a456-426614174000",
                "ip": "192.168.0.255", "name": "Ann", "opt": "xx", **fields}
    grammar = JsonSchemaGrammar(STRINGS)
    state = feed(json.dumps(instance, ensure_ascii=False), grammar)
    accepted = state is not None and grammar.is_complete(state)
    assert accepted == valid
    if accepted:
        assert CHECKER.is_valid(instance)


def test_random_walks_write_strings_that_fit_their_patterns() -> None:
    rng = random.Random(7)
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[ac]{1,3}x?$"},
                                               "z": {"type": "string", "minLength": 1, "maxLength": 2}},
              "required": ["a", "z"]}
    grammar = JsonSchemaGrammar(schema)
    walks = [random_walk(grammar, rng) for _ in range(200)]
    assert sum(w is not None for w in walks) > 100
    for text in filter(None, walks):
        jsonschema.validate(json.loads(text), schema)


BOUNDED = {"type": "object", "required": ["n", "a", "c", "x", "z"], "properties": {  # keys random_walk can spell
    "n": {"type": "integer", "minimum": 1, "maximum": 100},
    "a": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 7.5},
    "c": {"type": "integer", "maximum": -20},
    "x": {"type": "number", "minimum": 0, "maximum": 1.0},  # pydantic's confloat(ge=0, le=1)
    "z": {"type": "number", "exclusiveMinimum": -2, "exclusiveMaximum": 3},
}}


def test_bounded_numbers_are_exactly_those_within_bounds() -> None:
    """Every integer from -130 to 130 in each integer field, and decimals around the number
    fields' bounds: the grammar completes the object exactly when jsonschema finds it valid
    (numbers under bounds are plain decimals: no exponent)."""
    grammar = JsonSchemaGrammar(BOUNDED)
    validator = jsonschema.Draft202012Validator(BOUNDED)
    base = {"n": 50, "a": 0, "c": -21, "x": 0.5, "z": 0}
    head = '{"n": 50, "a": 0, "c": -21, '
    for field in ("n", "a", "c"):
        for i in range(-130, 131):
            instance = {**base, field: i}
            state = feed(json.dumps(instance), grammar)
            assert (state is not None and grammar.is_complete(state)) == validator.is_valid(instance), instance
    decimals = [f"{i}{f}" for i in range(-4, 5) for f in ("", ".0", ".00", ".5", ".05", ".999")] + ["-0.5", "-0.01"]
    for field, other in (("x", '"z": 0'), ("z", '"x": 0.5')):
        for value in decimals:
            text = head + (f'"x": {value}, {other}}}' if field == "x" else f'{other}, "z": {value}}}')
            state = feed(text, grammar)
            valid = validator.is_valid(json.loads(text))
            assert (state is not None and grammar.is_complete(state)) == valid, text
    for text in ('{"n": 007, "a": 0, "c": -21, "x": 0, "z": 0}', '{"n": 5, "a": -0, "c": -21, "x": 0, "z": 0}',
                 '{"n": 5.0, "a": 0, "c": -21, "x": 0, "z": 0}', head + '"x": 1.5, "z": 0}', head + '"x": 1e-1, "z": 0}'):
        state = feed(text, grammar)
        assert state is None or not grammar.is_complete(state), text


@pytest.mark.parametrize(("low", "high"), [
    (None, None), (0, None), (None, 0), (1, 100), (-100, -1), (-5, 5), (7, 7), (0, 0), (123, 4567),
    (-999, None), (None, -10), (95, 105), (-1, -1), (99, 100), (-2048, 1999),
])
def test_integer_ranges_as_regexes(low, high) -> None:
    regex = re.compile(integer_range_regex(low, high))
    for i in range(-2500, 2500):
        assert bool(regex.fullmatch(str(i))) == ((low is None or i >= low) and (high is None or i <= high)), i
    assert not any(regex.fullmatch(t) for t in ("007", "-0", "+5", "00", "1.0", ""))


def test_random_walks_write_integers_within_bounds() -> None:
    rng = random.Random(3)
    grammar = JsonSchemaGrammar(BOUNDED)
    walks = [w for w in (random_walk(grammar, rng) for _ in range(300)) if w is not None]
    assert len(walks) > 50
    for text in walks:
        jsonschema.validate(json.loads(text), BOUNDED)


def test_recursive_refs() -> None:
    tree = {
        "$defs": {"node": {"type": "object", "properties": {
            "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["v"]}},
        "$ref": "#/$defs/node",
    }
    grammar = JsonSchemaGrammar(tree)
    text = '{"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": [{"v": 4, "kids": []}]}]}'
    jsonschema.validate(json.loads(text), tree)
    assert grammar.is_complete(feed(text, grammar))
    assert feed('{"v": 1, "kids": [{"kids": []}]}', grammar) is None  # v is required


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "^(?=a)"}}},
     "#/properties/s: pattern '^(?=a)': group extensions"),
    ({"type": "object", "properties": {"s": {"type": "string", "format": "uri"}}}, "format 'uri' not supported"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "a", "maxLength": 3}}}, "one of pattern"),
    ({"type": "object", "properties": {"s": {"pattern": "a"}}}, 'pattern not supported without "type": "string"'),
    ({"type": "object", "properties": {"n": {"type": "number", "minimum": 0.5}}}, "minimum 0.5 not supported on a number"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 4}}}, "no integer lies within"),
    ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}, "multipleOf"),
    ({"type": "array", "prefixItems": [{}]}, "prefixItems"),
    ({"type": "object", "additionalProperties": {"type": "string"}}, "additionalProperties with a schema"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True}, "additionalProperties beside"),
    ({"type": "object", "properties": {"a": {"$ref": "http://x/y"}}}, "only local $ref"),
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}, {"enum": ["x"]}]}}},
     "alternatives that can begin with the same character"),
    ({"type": "string"}, "the root must be an object or an array"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required names unknown properties"),
])
def test_unsupported_schemas_are_refused_naming_the_keyword(schema: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"guided_decoding json_schema: .*{re.escape(message)}"):
        SamplingParams(guided_decoding={"json_schema": schema})


def test_a_schema_nested_too_deep_is_refused_not_a_crash() -> None:
    schema: dict = {"type": "object"}
    for _ in range(2000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match="nested deeper than"):
        SamplingParams(guided_decoding={"json_schema": schema})


def random_instance(schema: dict, rng: random.Random):
    """A value of one of random_schema's schemas (objects keep the schema's key order)."""
    if "enum" in schema or "const" in schema:
        return rng.choice(schema["enum"]) if "enum" in schema else schema["const"]
    if "anyOf" in schema:
        return random_instance(rng.choice(schema["anyOf"]), rng)
    kind = schema.get("type")
    if isinstance(kind, list):
        return random_instance({**schema, "type": rng.choice(kind)}, rng)
    if kind == "object":
        props = schema.get("properties")
        if props is None:
            return random_object(rng)
        required = set(schema.get("required", ()))
        return {k: random_instance(s, rng) for k, s in props.items() if k in required or rng.random() < 0.5}
    if kind == "array":
        low, high = schema.get("minItems", 0), schema.get("maxItems", schema.get("minItems", 0) + 2)
        return [random_instance(schema["items"], rng) for _ in range(rng.randint(low, high))]
    if kind in ("string", "number", "integer", "boolean", "null"):
        makers = {"string": lambda: 'q"\\\u00e9\n', "number": lambda: rng.uniform(-5, 5),
                  "integer": lambda: rng.randint(-9, 99), "boolean": lambda: rng.random() < 0.5,
                  "null": lambda: None}
        return makers[kind]()
    return random_value(rng)  # {}: any value


def test_random_instances_of_random_schemas_are_accepted() -> None:
    rng = random.Random(8)
    for _ in range(300):
        schema = {"type": "object", "properties": {"x": random_schema(rng)}, "required": ["x"]}
        instance = random_instance(schema, rng)
        jsonschema.validate(instance, schema)
        text = json.dumps(instance, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))
        grammar = JsonSchemaGrammar(schema)
        state = feed(text, grammar)
        assert state is not None and grammar.is_complete(state), (schema, text)


def _whitespace_mutations(text: str, rng: random.Random) -> list[str]:
    """The text with a space, newline or tab put in, or one of its spaces taken out."""
    out = []
    for _ in range(6):
        i = rng.randrange(len(text) + 1)
        if rng.random() < 0.5 and " " in text:
            j = rng.choice([k for k, c in enumerate(text) if c == " "])
            out.append(text[:j] + text[j + 1:])
        else:
            out.append(text[:i] + rng.choice(" \n\t") + text[i:])
    return out


@pytest.mark.parametrize("which", ["json_object", "json_schema"])
def test_compact_json_spaces_as_xgrammar_without_any_whitespace(which: str) -> None:
    """vLLM's disable_any_whitespace: one space after each `,` and `:`, none elsewhere, byte
    for byte as xgrammar (vLLM's backend) takes JSON compiled with any_whitespace=False, on
    json.dumps' texts (its default separators are those) and on them with spaces moved."""
    import xgrammar as xgr

    from worker.guided.json_grammar import COMPACT_JSON_OBJECT

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]))
    rng = random.Random(11)
    checked = 0
    for _ in range(40):
        if which == "json_object":
            value, schema, grammar = random_object(rng), {"type": "object"}, COMPACT_JSON_OBJECT
        else:
            schema = {"type": "object", "properties": {"x": random_schema(rng), "y": {"type": "integer"}},
                      "required": ["x", "y"], "additionalProperties": False}
            value, grammar = random_instance(schema, rng), JsonSchemaGrammar(schema, compact=True)
            value["y"] = value.get("y", 3)
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        text = json.dumps(value, ensure_ascii=False)
        assert grammar_takes(grammar, text) == (len(text.encode()), True), text
        for variant in [json.dumps(value, separators=(",", ":")), json.dumps(value, indent=2),
                        *_whitespace_mutations(text, rng)]:
            assert grammar_takes(grammar, variant) == xgrammar_takes(compiled, variant), variant
            checked += 1
    assert checked == 40 * 8


def test_compact_json_is_asked_for_by_name() -> None:
    params = SamplingParams(structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True})
    assert params.guided_decoding == {"json_schema": {"type": "object"}, "disable_any_whitespace": True}
    regex = SamplingParams(structured_outputs={"regex": "a b", "disable_any_whitespace": True})
    assert regex.guided_decoding == {"regex": "a b"}  # a pattern says its own spaces
    with pytest.raises(ValueError, match="disable_any_whitespace must be true or false"):
        SamplingParams(guided_decoding={"json_object": True, "disable_any_whitespace": "yes"})
