"""The bundled trace generator: deterministic, the documented session shapes, and token lengths that match its
parameters on a real tokenizer (SmolLM2's)."""

from __future__ import annotations

import json

import pytest

from freetoken.errors import FreeTokenError
from freetoken.eval import shapes
from freetoken.eval.trace import trace_lines


@pytest.fixture(scope="module")
def count(smollm2_gguf):
    from freetoken.engine.formats.gguf_file import GGUFFile
    from freetoken.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(smollm2_gguf).metadata)
    return lambda text: len(tokenizer.encode(text))


@pytest.mark.parametrize("name", shapes.names())
def test_the_same_seed_gives_the_same_bytes_and_another_seed_other_text(name):
    assert trace_lines(shapes.generate(name)) == trace_lines(shapes.generate(name))
    assert trace_lines(shapes.generate(name, seed=1)) != trace_lines(shapes.generate(name))


def test_claude_code_shape(count):
    trace = shapes.generate("claude-code")
    main = [t for t in trace.turns if t.session == "main"]
    task = [t for t in trace.turns if t.session == "task-1"]
    assert len(main) == 16 and len(task) == 5 and all(t.protocol == "anthropic" for t in trace.turns)
    first = main[0]
    system = count(first.request["system"][1]["text"])
    tools = sum(count(t["description"]) for t in first.request["tools"])
    assert abs(system - 9000) < 900 and abs(tools - 13000) < 1300, (system, tools)  # the ≈22k-token prefix
    assert len(first.request["tools"]) == 18
    # the subagent starts after the turn whose reply spawned it, and the main session waits for its last turn
    spawner = main[5]
    assert task[0].after == (spawner.id,) and task[0].parent is None
    assert main[6].after == (spawner.id, task[-1].id) and main[6].label == "after_subagent"
    tool_use = main[6].messages[-2]["content"][1]
    assert tool_use["name"] == "Task" and main[6].messages[-1]["content"][0]["tool_use_id"] == tool_use["id"]
    # the context edit: older tool results cleared, so the request shares only a beginning with its parent
    edit = next(t for t in main if t.label == "edit")
    parent = trace.turn(edit.parent)
    from freetoken.eval.trace import common_prefix

    keep = common_prefix(parent.messages, edit.messages)
    assert 2 <= keep < len(parent.messages)
    assert "cleared" in json.dumps(edit.messages[keep])
    # every tool_use is answered by the next message's tool_result
    for turn in trace.turns:
        for m, reply in zip(turn.messages, turn.messages[1:], strict=False):
            uses = [b["id"] for b in m["content"] if isinstance(m["content"], list) and b["type"] == "tool_use"]
            if uses:
                assert [b["tool_use_id"] for b in reply["content"] if b["type"] == "tool_result"] == uses


def test_opencode_sends_its_title_request_beside_the_first_turn():
    trace = shapes.generate("opencode")
    title, first = trace.turns[0], trace.turns[1]
    assert (title.session, title.after, first.after) == ("title", (), ())
    assert len([t for t in trace.turns if t.session == "main"]) == 14
    last = trace.turns[-1]
    assert last.messages[-1]["role"] == "tool" and last.messages[-2]["tool_calls"][0]["id"] == \
        last.messages[-1]["tool_call_id"]


def test_codex_rewinds_to_an_earlier_turn():
    trace = shapes.generate("codex")
    assert len(trace.turns) == 12 and {t.protocol for t in trace.turns} == {"responses"}
    rewind = next(t for t in trace.turns if t.label == "rewind")
    assert rewind.parent == "main-06" and rewind.after == ("main-08",)
    assert rewind.messages[:-1] == trace.turn("main-06").messages
    assert trace.turns[0].request["reasoning"]["effort"] == "medium"


def test_openclaw_sits_on_a_24k_token_floor(count):
    trace = shapes.generate("openclaw")
    assert len(trace.turns) == 13
    first = trace.turns[0]
    floor = count(first.messages[0]["content"]) + sum(count(t["function"]["description"])
                                                      for t in first.request["tools"])
    assert 21_600 <= floor <= 26_400, floor
    assert sum(t.label == "tool_call" for t in trace.turns) == 4


def test_reasoning_is_one_long_reply():
    (turn,) = shapes.generate("reasoning").turns
    assert turn.output_tokens == 2048 and turn.request["reasoning_effort"] == "high"


def test_scale_shrinks_lengths_not_counts(count):
    small = shapes.generate("claude-code", scale=0.05)
    assert len(small.turns) == len(shapes.generate("claude-code").turns)
    assert count(small.turns[0].request["system"][1]["text"]) < 9000 * 0.1


def test_parameters_are_checked():
    assert len(shapes.generate("opencode", turns=5).turns) == 6
    with pytest.raises(FreeTokenError, match="trace opencode has no parameter colour; its parameters are"):
        shapes.generate("opencode", colour=1)
    with pytest.raises(FreeTokenError, match="no bundled trace 'nope'"):
        shapes.generate("nope")
    with pytest.raises(FreeTokenError, match="scale must be above 0"):
        shapes.generate("codex", scale=0)
