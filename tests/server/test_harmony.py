"""gpt-oss's Harmony replies → reasoning, text and tool calls, on strings in the real format, streamed in any
cut; the template's call syntax is told apart, forced calls open with the call's header, and a Harmony
vocabulary keeps its message markers in decoded text."""

from __future__ import annotations

import json

import pytest

from freetoken.server.harmony import HarmonyParser
from freetoken.server.tool_choice import ToolChoice, call_opener, call_syntax

ANSWER = ("<|channel|>analysis<|message|>The user asks for the capital. It is Paris.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>The capital of France is Paris.")
CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris", "days": 2}')
CALL_IN_ROLE = ("<|channel|>analysis<|message|>Look it up.<|end|>"
                "<|start|>assistant to=functions.search<|channel|>commentary json<|message|>"
                '{"query": "<|end|> ok"}')
PREAMBLE = ("<|channel|>commentary<|message|>Let me check that for you.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}")


def _parse(text: str, cut: int | None, **kwargs) -> list[tuple[str, str]]:
    """Fed in pieces of `cut` characters (None: all at once); parts merged by kind as a client would show them."""
    parser = HarmonyParser(**kwargs)
    pieces = [text] if cut is None else [text[i:i + cut] for i in range(0, len(text), cut)]
    parts = [p for piece in pieces for p in parser.push(piece)] + parser.finish()
    out: list[tuple[str, str]] = []
    for p in parts:
        value = json.dumps([p.call.name, p.call.arguments]) if p.kind == "tool_call" else p.text
        if out and out[-1][0] == p.kind and p.kind != "tool_call":
            out[-1] = (p.kind, out[-1][1] + value)
        else:
            out.append((p.kind, value))
    return out


@pytest.mark.parametrize("cut", [None, 1, 3, 7])
def test_reasoning_and_the_final_answer_separate(cut):
    assert _parse(ANSWER, cut) == [("reasoning", "The user asks for the capital. It is Paris."),
                                   ("text", "The capital of France is Paris.")]


@pytest.mark.parametrize("cut", [None, 1, 5])
def test_a_tool_call_is_read_from_its_header_and_json_body(cut):
    assert _parse(CALL, cut) == [("reasoning", "Need the weather tool."),
                                 ("tool_call", json.dumps(["get_weather", {"city": "Paris", "days": 2}]))]


def test_the_recipient_may_stand_in_the_role_part_and_markers_in_arguments_stay_text():
    """`<|end|>` inside a JSON string is text of the arguments here: a call's body runs to the stop token."""
    got = _parse(CALL_IN_ROLE, 2)
    assert got[0] == ("reasoning", "Look it up.")
    assert got[1][0] == "tool_call" and json.loads(got[1][1])[0] == "search"


def test_a_preamble_on_the_commentary_channel_is_text_before_the_call():
    assert _parse(PREAMBLE, 4) == [("text", "Let me check that for you."),
                                   ("tool_call", json.dumps(["get_weather", {}]))]


def test_arguments_that_are_not_an_object_come_back_as_text():
    bad = CALL.replace('{"city": "Paris", "days": 2}', '{"city": "Par')
    assert _parse(bad, None)[-1] == ("text", '{"city": "Par')


def test_without_tools_a_call_is_shown_as_text():
    assert _parse(CALL, 3, tools=False)[-1] == ("text", '{"city": "Paris", "days": 2}')


def test_text_without_any_header_is_text():
    assert _parse("Just words.", 2) == [("text", "Just words.")]


@pytest.mark.parametrize("choice", [ToolChoice("named", "get_weather"), ToolChoice("required")])
def test_a_forced_call_opens_with_the_call_header(choice):
    template = "{{ '<|start|>' + role + '<|channel|>' + channel + '<|message|>' }}"
    assert call_syntax(template) == "harmony"
    opener = call_opener(choice, "harmony")
    assert opener.startswith("<|channel|>commentary to=functions.")
    rest = '{"city": "Oslo"}' if choice.name else 'get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    parser = HarmonyParser(prefix=opener)
    parts = parser.push(rest) + parser.finish()
    assert [(p.kind, p.call.name, p.call.arguments) for p in parts] == [("tool_call", "get_weather",
                                                                          {"city": "Oslo"})]


def test_a_harmony_vocabulary_keeps_its_markers_in_decoded_text(tmp_path):
    """The markers are special tokens of gpt-oss's vocabulary; decoding a reply (special tokens skipped) must keep
    them, or the parser would see the channels run together."""
    from freetoken.engine.tokenizer import HARMONY_MARKERS, Tokenizer
    from support.checkpoints import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens(list(HARMONY_MARKERS) + ["<|return|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    ids = loaded.encode("<|channel|>final<|message|>Paris<|return|>")
    assert loaded.decode(ids, skip_special_tokens=True) == "<|channel|>final<|message|>Paris"
