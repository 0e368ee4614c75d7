"""The span-preserving JSON/JSONC/JSON5 editor: values set where asked, every other byte kept."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.launchers.jsonish import ConfigSyntaxError, get_value, loads, set_value

JSONC = """{
  // the user's own settings
  "theme": "dark", /* inline */
  "env": {
    "FOO": "bar" // keep me
  },
  "list": [1, 2, 3,],
}
"""

JSON5 = """// OpenClaw, as a person writes it
{
  agents: { defaults: { workspace: '~/work', }, },
  models: {
    mode: 'merge',
    providers: {
      other: { baseUrl: 'http://example', apiKey: "x", },
    },
  },
  limits: [0x10, +1, .5, 5., Infinity, -Infinity],
  note: 'it\\'s \\x41 line \\
continued',
}
"""


def _lines_kept(old: str, new: str) -> None:
    """Every line of `old` is still in `new`, in order (a changed value's line aside)."""
    it = iter(new.splitlines())
    for line in old.splitlines():
        assert any(line == candidate for candidate in it), f"lost or reordered: {line!r}"


def test_jsonc_new_key_goes_in_beside_its_siblings_and_everything_else_stays():
    new = set_value(JSONC, ("env", "ANTHROPIC_BASE_URL"), "http://127.0.0.1:1919", "jsonc")
    assert loads(new, "jsonc")["env"] == {"FOO": "bar", "ANTHROPIC_BASE_URL": "http://127.0.0.1:1919"}
    assert '    "FOO": "bar", // keep me\n    "ANTHROPIC_BASE_URL": "http://127.0.0.1:1919"\n' in new
    assert new.replace(',', '').replace('\n    "ANTHROPIC_BASE_URL": "http://127.0.0.1:1919"', '') == \
        JSONC.replace(',', '')


def test_a_changed_value_is_the_only_span_that_changes():
    new = set_value(JSONC, ("theme",), "light", "jsonc")
    assert new == JSONC.replace('"dark"', '"light"')


def test_setting_an_equal_value_leaves_the_text_identical():
    assert set_value(JSONC, ("list",), [1, 2, 3], "jsonc") is JSONC
    assert set_value(JSON5, ("models", "mode"), "merge", "json5") is JSON5
    assert set_value('{"a": 1}', ("a",), True, "json") == '{"a": true}'  # True is not 1


def test_json5_is_read_in_full():
    doc = loads(JSON5, "json5")
    assert doc["agents"] == {"defaults": {"workspace": "~/work"}}
    assert doc["limits"][:4] == [16, 1, 0.5, 5.0] and doc["limits"][4:] == [math.inf, -math.inf]
    assert doc["note"] == "it's A line continued"


def test_json5_new_members_follow_the_files_bare_keys_and_trailing_commas():
    new = set_value(JSON5, ("models", "providers", "freetoken"), {"baseUrl": "http://127.0.0.1:1919/v1"}, "json5")
    new = set_value(new, ("agents", "defaults", "model", "primary"), "freetoken/m", "json5")
    doc = loads(new, "json5")
    assert doc["models"]["providers"]["freetoken"] == {"baseUrl": "http://127.0.0.1:1919/v1"}
    assert doc["models"]["providers"]["other"]["apiKey"] == "x"
    assert doc["agents"]["defaults"] == {"workspace": "~/work", "model": {"primary": "freetoken/m"}}
    assert "\n      freetoken: {" in new and new.count("// OpenClaw, as a person writes it") == 1
    _lines_kept("\n".join(line for line in JSON5.splitlines() if "agents" not in line), new)


def test_json5_single_quoted_value_stays_single_quoted():
    assert set_value(JSON5, ("models", "mode"), "replace", "json5") == JSON5.replace("'merge'", "'replace'")


def test_objects_are_created_along_the_path_and_a_scalar_in_the_way_is_replaced():
    assert loads(set_value("{}", ("a", "b", "c"), 1, "json"), "json") == {"a": {"b": {"c": 1}}}
    assert loads(set_value('{"a": 3}', ("a", "b"), 1, "json"), "json") == {"a": {"b": 1}}
    assert set_value("", ("a",), "x", "json") == '{\n  "a": "x"\n}\n'
    assert set_value('{"a": 1}', ("b",), 2, "json") == '{"a": 1, "b": 2}'


def test_crlf_files_get_crlf_lines_and_tabs_stay_tabs():
    text = '{\r\n\t"a": 1\r\n}\r\n'
    new = set_value(text, ("b",), {"c": 2}, "json")
    assert new == '{\r\n\t"a": 1,\r\n\t"b": {\r\n\t\t"c": 2\r\n\t}\r\n}\r\n'


def test_an_empty_object_with_a_comment_keeps_the_comment():
    new = set_value('{\n  "env": { /* mine */ }\n}\n', ("env", "X"), "1", "jsonc")
    assert "/* mine */" in new and loads(new, "jsonc") == {"env": {"X": "1"}}


@pytest.mark.parametrize("text, dialect, where", [
    ('{"a": 1,}', "json", "line 1, column 8"),
    ('{\n  // no comments in JSON\n}', "json", "line 2"),
    ("{'a': 1}", "jsonc", "line 1"),
    ('{"a": 1', "jsonc", "line 1"),
    ('{"a": "x\ny"}', "json5", "line 1"),
    ('[1, 2]', "json", None),
])
def test_invalid_text_is_refused_with_its_place(text, dialect, where):
    if where is None:  # valid, but no object at the top: cannot take a key
        with pytest.raises(ConfigSyntaxError, match="top level"):
            set_value(text, ("a",), 1, dialect)
        return
    with pytest.raises(ConfigSyntaxError, match=where):
        loads(text, dialect)


def test_get_value_reads_paths():
    assert get_value(JSONC, ("env", "FOO"), "jsonc") == "bar"
    assert get_value(JSONC, ("env", "NOPE"), "jsonc", default=0) == 0
    assert get_value("", ("a",), "json") is None


_keys = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=6)
_scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=3),
                       max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=5), st.lists(_keys, min_size=1, max_size=3), _values,
       st.sampled_from([None, 2, 4]))
def test_any_json_document_takes_any_value_at_any_path(doc, path, value, indent):
    text = json.dumps(doc, indent=indent, ensure_ascii=False)
    new = set_value(text, tuple(path), value, "json")
    expected, node = json.loads(text), None
    node = expected
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[path[-1]] = value
    assert json.loads(new) == expected  # strict JSON still, and exactly the change
