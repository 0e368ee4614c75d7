"""The JSON-object prefix automaton behind `response_format`: every prefix of a JSON object is accepted, the
object is complete exactly at its end, and on arbitrary text it agrees with a strict JSON parser."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.engine.json_prefix import JsonPrefix

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner,
                                                                                            max_size=4),
                      max_leaves=12)
objects = st.dictionaries(st.text(max_size=8), values, max_size=5)


def _strict(text: str):
    def refuse(name):
        raise ValueError(name)

    return json.loads(text, parse_constant=refuse)


@settings(max_examples=200, deadline=None)
@given(objects, st.sampled_from([None, 0, 2]), st.booleans())
def test_every_prefix_of_an_object_is_accepted_and_complete_only_at_the_end(obj, indent, ascii_only):
    text = json.dumps(obj, indent=indent, ensure_ascii=ascii_only)
    state = JsonPrefix()
    for i, c in enumerate(text):
        assert not state.complete
        assert state.feed(c), (text, i)
    assert state.complete
    assert state.accepts("  \n") and not state.accepts("x") and not state.accepts("{}")


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet='{}[]":,. -+0123456789eEtrufalsn\\\n\tabu', max_size=24))
def test_on_any_text_it_agrees_with_a_strict_parser(text):
    state = JsonPrefix()
    ours = state.feed(text) and state.complete
    try:
        theirs = isinstance(_strict(text), dict)
    except ValueError:
        theirs = False
    assert ours == theirs, text


@pytest.mark.parametrize("bad", ['[1]', '"x"', '{"a": 01}', '{"a": 1.}', '{"a": -}', '{"a": .5}', '{"a": 1,}',
                                 '{"a" 1}', '{,}', '{"a": tru}', '{"a": "\x01"}', '{"a": "\\x"}', '{"a": NaN}',
                                 '{"a": 1}}', '{"a": [1,]}'])
def test_refusals(bad):
    state = JsonPrefix()
    assert not (state.feed(bad) and state.complete)


def test_accepts_leaves_the_state_alone():
    state = JsonPrefix()
    assert state.feed('{"key": [1, {"x": "a')
    assert state.accepts('b"}]}') and not state.accepts('"]')  # a string closes, then an object may not take ]
    assert state.feed('b"}]}') and state.complete


def test_whitespace_between_tokens_is_bounded_but_not_inside_strings():
    """A model that prefers whitespace cannot pad a constrained reply forever: at most MAX_WHITESPACE in a row
    between tokens (a deep indent fits), any amount inside a string."""
    from freetoken.engine.json_prefix import MAX_WHITESPACE

    assert JsonPrefix().feed("{" + "\n" + " " * (MAX_WHITESPACE - 1) + '"a"')
    assert not JsonPrefix().feed("{" + " " * (MAX_WHITESPACE + 1))
    assert JsonPrefix().feed('{"a": "' + " " * 200 + '"' + " " * MAX_WHITESPACE + "}")
    assert JsonPrefix().feed("{" + " " * MAX_WHITESPACE + '"a"' + " " * MAX_WHITESPACE + ":")


def test_whitespace_between_a_calls_parts_is_bounded():
    from freetoken.engine.call_languages import HermesCalls
    from freetoken.engine.json_prefix import MAX_WHITESPACE
    from freetoken.engine.tag_calls import QwenXmlCalls

    calls = HermesCalls(names=("f",))
    assert calls.feed("<tool_call>" + " " * MAX_WHITESPACE) and not calls.copy().feed(" ")
    assert calls.feed('{"name": "f", "arguments": {}}' + "\n" * MAX_WHITESPACE) and not calls.copy().feed("\n")
    xml = QwenXmlCalls(tools=(("f", ("code",)),))
    assert xml.feed("<tool_call>\n<function=f>\n<parameter=code>\n" + " " * 100 + "x\n</parameter>")  # free text
    assert not xml.copy().feed(" " * (MAX_WHITESPACE + 1))
