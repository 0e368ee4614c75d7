"""The JSON-schema constraint behind `response_format: json_schema`: every prefix of a valid instance is
accepted and the object completes at its end; what the schema rules out is refused at the first character
that commits to it; what the constraint does not understand stays free."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.engine.json_schema import SchemaError, SchemaPrefix, compile_schema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "height": {"type": ["number", "null"]},
        "tags": {"type": "array", "items": {"enum": ["a", "bc", "b\"q"]}},
        "kind": {"enum": ["cat", "dog", 3, True, None]},
        "address": {"$ref": "#/$defs/Address"},
        "children": {"type": "array", "items": {"$ref": "#"}},  # recursive
        "extra": {"anyOf": [{"type": "string"}, {"type": "integer"}]},  # not understood: free
    },
    "required": ["name", "age"],
    "additionalProperties": False,
    "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"const": "75001"}},
                          "required": ["city"]}},
}


def _run(schema: dict, text: str) -> tuple[bool, bool]:
    state = SchemaPrefix(compile_schema(json.dumps(schema)))
    return state.feed(text), state.complete


@pytest.mark.parametrize("text", [
    '{"name": "x", "age": 3}',
    '{"age": -12, "name": "Zoë", "kind": "cat"}',
    '{"name":"x","age":3,"tags":["a","bc","b\\"q"],"height":1.5e3}',
    '{"name":"x","age":0,"height":null,"kind":null,"extra":[1,{"any":"thing"}]}',
    '{"name":"x","age":3,"kind":true,"address":{"city":"Paris","zip":"75001","other":1}}',
    '{"name":"a","age":1,"children":[{"name":"b","age":2,"children":[]}]}',
])
def test_valid_instances_are_accepted_and_complete(text):
    assert _run(PERSON, text) == (True, True)


@pytest.mark.parametrize("text, why", [
    ('{"name": "x"}', "a required key missing at the close"),
    ('{"age": 3.5', "a fraction in an integer"),
    ('{"age": 1e3', "an exponent in an integer"),
    ('{"nax', "a key no property starts with"),
    ('{"name":"x","age":3,"other"', "an unlisted key (additionalProperties: false)"),
    ('{"name":"x","name"', "a key twice"),
    ('{"name": 5', "a number where a string is due"),
    ('{"name":"x","age":3,"tags":["b"]', "a value outside the enum"),
    ('{"name":"x","age":3,"kind":4', "a number outside the enum"),
    ('{"name":"x","age":3,"kind":"cow', "a string no enum value starts with"),
    ('{"name":"x","age":3,"height":"tall"', "a string where number or null is due"),
    ('{"name":"x","age":3,"address":{"zip":"75002"', "a const broken"),
    ('{"name":"x","age":3,"address":{}', "a nested required key"),
    ('{"name":"a","age":1,"children":[{"age":2}]', "the recursive schema's required key"),
])
def test_what_the_schema_rules_out_is_refused(text, why):
    assert _run(PERSON, text)[0] is False, why


def test_a_closed_object_with_every_key_written_takes_no_comma():
    small = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}
    assert _run(small, '{"a": 1') == (True, False)
    assert _run(small, '{"a": 1,')[0] is False and _run(small, '{"a": 1}') == (True, True)


def test_unreadable_schemas_are_refused():
    with pytest.raises(SchemaError, match="points at nothing"):
        compile_schema(json.dumps({"$ref": "#/$defs/Missing"}))
    with pytest.raises(SchemaError, match="local"):
        compile_schema(json.dumps({"$ref": "https://example.com/schema.json"}))
    with pytest.raises(SchemaError, match="must be an object"):
        compile_schema("[1]")


def _instances(schema: dict, root: dict, depth: int = 0):
    """A strategy of values valid under the subset `PERSON` uses (resolving its refs)."""
    if "$ref" in schema:
        ref = schema["$ref"]
        target = root if ref == "#" else root["$defs"][ref.rsplit("/", 1)[1]]
        return _instances(target, root, depth)
    if "anyOf" in schema:
        return st.one_of(*(_instances(s, root, depth) for s in schema["anyOf"]))
    if "enum" in schema or "const" in schema:
        return st.sampled_from(schema.get("enum", [schema.get("const")]))
    kinds = schema.get("type", "object")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    options = []
    for kind in kinds:
        if kind == "string":
            options.append(st.text(max_size=6))
        elif kind == "integer":
            options.append(st.integers(-10**6, 10**6))
        elif kind == "number":
            options.append(st.floats(allow_nan=False, allow_infinity=False) | st.integers())
        elif kind == "null":
            options.append(st.none())
        elif kind == "array":
            options.append(st.lists(_instances(schema["items"], root, depth + 1), max_size=0 if depth > 1 else 3))
        elif kind == "object":
            props = schema.get("properties", {})
            required = set(schema.get("required", []))
            optional = [k for k in props if k not in required and (depth < 2 or "$ref" not in json.dumps(props[k]))]
            options.append(st.fixed_dictionaries(
                {k: _instances(props[k], root, depth + 1) for k in required},
                optional={k: _instances(props[k], root, depth + 1) for k in optional}))
    return st.one_of(*options)


@settings(max_examples=200, deadline=None)
@given(_instances(PERSON, PERSON), st.sampled_from([None, 0, 2]), st.booleans(), st.randoms())
def test_every_prefix_of_a_generated_valid_instance_is_accepted(instance, indent, shuffle, rnd):
    if shuffle:  # key order is free
        items = list(instance.items())
        rnd.shuffle(items)
        instance = dict(items)
    text = json.dumps(instance, indent=indent, ensure_ascii=False)
    state = SchemaPrefix(compile_schema(json.dumps(PERSON)))
    for i, c in enumerate(text):
        assert not state.complete
        assert state.feed(c), (text, i)
    assert state.complete
