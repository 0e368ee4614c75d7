"""The trace format: what it reads, what it refuses (naming the line), and that writing then reading a trace
gives back every request whole."""

from __future__ import annotations

import json

import pytest

from freetoken.eval import shapes
from freetoken.eval.trace import TraceError, parse_trace, read_trace, trace_lines, write_trace

HEADER = json.dumps({"type": "header", "format": "freetoken-trace", "version": 1, "name": "t"})


def _turn(**fields) -> str:
    base = {"type": "turn", "id": "a", "session": "s", "protocol": "openai", "request": {"max_tokens": 8},
            "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({**base, **fields})


def test_a_turn_continues_its_parent_with_keep_and_append():
    lines = [HEADER, _turn(),
             json.dumps({"type": "turn", "id": "b", "session": "s", "parent": "a",
                         "append": [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]}),
             json.dumps({"type": "turn", "id": "c", "session": "s", "parent": "b", "keep": 1,
                         "append": [{"role": "user", "content": "edited"}], "output_tokens": 5, "think_s": 0.5})]
    trace = parse_trace(lines)
    a, b, c = trace.turns
    assert b.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                          {"role": "user", "content": "more"}]
    assert b.request == a.request and b.protocol == "openai" and b.after == ("a",)
    assert c.messages == [{"role": "user", "content": "hi"}, {"role": "user", "content": "edited"}]
    assert (c.output_tokens, c.think_s, c.after) == (5, 0.5, ("b",))
    body = c.body("m")
    assert body["model"] == "m" and body["stream"] is True and body["messages"] == c.messages


def test_a_parentless_turn_comes_after_its_sessions_previous_turn():
    trace = parse_trace([HEADER, _turn(), _turn(id="b"), _turn(id="x", session="other")])
    assert [t.after for t in trace.turns] == [(), ("a",), ()]


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: each line must be a JSON object"),
    (_turn(protocol="grpc"), "line 2: protocol 'grpc' is unknown; use one of anthropic, openai, responses"),
    (_turn(id=""), "line 2: missing field 'id'"),
    (json.dumps({"type": "turn", "id": "a", "protocol": "openai", "request": {}, "messages": [1]}),
     "line 2: missing field 'session'"),
    (json.dumps({"type": "turn", "id": "a", "session": "s", "protocol": "openai", "messages": [1]}),
     "line 2: turn 'a' needs a request object"),
    (_turn(messages=[]), "line 2: turn 'a' has no messages"),
    (json.dumps({"type": "turn", "id": "a", "session": "s", "parent": "zz"}),
     "line 2: turn 'a' names parent 'zz', which no earlier line defines"),
    (_turn(after=["later"]), "line 2: turn 'a' comes after 'later', which no earlier line defines"),
    (_turn(output_tokens=0), "line 2: output_tokens must be a positive integer or null"),
    (_turn(think_s=-1), "line 2: think_s must be a number of seconds"),
    (_turn(request={"model": "x"}), "line 2: the request must not hold model, messages or input"),
    (_turn(colour="red"), "line 2: unknown field(s) colour"),
    (json.dumps({"type": "note"}), "line 2: unknown record type 'note'"),
])
def test_a_bad_line_is_refused_naming_it(line, message):
    with pytest.raises(TraceError, match="^" + _escaped(f"trace.jsonl {message}")):
        parse_trace([HEADER, line], "trace.jsonl")


def test_keep_past_the_parents_messages_is_refused():
    child = json.dumps({"type": "turn", "id": "b", "session": "s", "parent": "a", "keep": 5})
    with pytest.raises(TraceError, match=r"line 3: keep must be 0\.\.1 \(the parent's messages\), got 5"):
        parse_trace([HEADER, _turn(), child], "t")


def test_duplicate_ids_name_both_lines():
    with pytest.raises(TraceError, match=r"line 3: turn id 'a' is used twice \(also line 2\)"):
        parse_trace([HEADER, _turn(), _turn()], "t")


@pytest.mark.parametrize("first, message", [
    (_turn(), "line 1: the first line must be the header"),
    (HEADER.replace('"version": 1', '"version": 7'), "line 1: trace version 7; this freetoken reads version 1"),
])
def test_the_header_is_checked(first, message):
    with pytest.raises(TraceError, match=_escaped(message)):
        parse_trace([first, _turn()], "t")


def test_empty_and_header_only_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="is empty; a trace starts with a header line"):
        read_trace(tmp_path / "empty.jsonl")
    (tmp_path / "h.jsonl").write_text(HEADER + "\n")
    with pytest.raises(TraceError, match="has a header but no turns"):
        read_trace(tmp_path / "h.jsonl")
    with pytest.raises(TraceError, match="cannot read the trace"):
        read_trace(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("name", shapes.names())
def test_every_bundled_trace_round_trips_through_its_file(name, tmp_path):
    trace = shapes.generate(name, scale=0.2)
    back = read_trace(write_trace(trace, tmp_path / f"{name}.jsonl"))
    assert [t.id for t in back.turns] == [t.id for t in trace.turns]
    for mine, theirs in zip(trace.turns, back.turns, strict=True):
        assert theirs.messages == mine.messages and theirs.request == mine.request
        assert (theirs.after, theirs.parent, theirs.protocol) == (mine.after, mine.parent, mine.protocol)
        assert (theirs.output_tokens, theirs.think_s, theirs.label) == (mine.output_tokens, mine.think_s, mine.label)
    # continuation turns are written as what they add, so the file grows with the conversation, not its square
    total = sum(len(json.dumps(t.messages)) for t in trace.turns)
    assert sum(len(line) for line in trace_lines(trace)) < total / 2 or len(trace.turns) == 1


def _escaped(text: str) -> str:
    import re

    return re.escape(text)
