"""Generated text split into answer, reasoning and tool calls, whatever the deltas' boundaries."""

from __future__ import annotations

import json

import pytest

from freetoken.server.output import OutputParser, parse_tool_call

HERMES = ('Let me look.<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
          '<tool_call>\n{"name": "ls", "arguments": "{}"}\n</tool_call>')
QWEN3_CODER = ("<tool_call>\n<function=edit>\n<parameter=path>\nsrc/x.py\n</parameter>\n<parameter=count>\n3\n"
               "</parameter>\n</function>\n</tool_call>")


def _run(text: str, sizes: list[int], **kw) -> list[tuple]:
    """Feeds `text` in deltas of the given sizes (cycled); returns merged (kind, text or call) parts."""
    parser, parts, at, i = OutputParser(**kw), [], 0, 0
    while at < len(text):
        n = sizes[i % len(sizes)]
        parts += parser.push(text[at:at + n])
        at, i = at + n, i + 1
    parts += parser.finish()
    merged: list[tuple] = []
    for p in parts:
        if p.kind == "tool_call":
            merged.append(("tool_call", p.call.name, p.call.arguments))
        elif merged and merged[-1][0] == p.kind:
            merged[-1] = (p.kind, merged[-1][1] + p.text)
        else:
            merged.append((p.kind, p.text))
    return merged


@pytest.mark.parametrize("sizes", [[1], [2], [3, 7], [5, 1, 11], [1000]])
def test_tool_calls_and_reasoning_survive_any_delta_boundaries(sizes):
    text = "<think>\nplan: read it</think>\n\n" + HERMES + " done"
    assert _run(text, sizes) == [
        ("reasoning", "\nplan: read it"), ("text", "Let me look."),
        ("tool_call", "read_file", {"path": "a.py"}), ("tool_call", "ls", {}), ("text", " done")]


@pytest.mark.parametrize("sizes", [[1], [4], [1000]])
def test_qwen3_coder_xml_calls(sizes):
    assert _run(QWEN3_CODER, sizes) == [("tool_call", "edit", {"path": "src/x.py", "count": 3})]


def test_a_prompt_that_opened_reasoning_starts_in_it():
    assert _run("thinking...</think>answer", [3], in_reasoning=True) == [("reasoning", "thinking..."),
                                                                          ("text", "answer")]


def test_without_tools_the_tags_are_text_and_broken_calls_stay_visible():
    assert _run(HERMES, [4], tools=False) == [("text", HERMES)]
    broken = "<tool_call>{not json}</tool_call>"
    assert _run(broken, [2]) == [("text", broken)]
    assert _run("<tool_call>{\"name\": \"f\", \"arguments\": {}}", [3]) == [("tool_call", "f", {})]  # unclosed
    assert _run("<tool_call>{\"na", [3]) == [("text", "<tool_call>{\"na")]
    assert _run("a <b> c </thi", [2]) == [("text", "a <b> c </thi")]  # held-back tag prefixes come out


def test_parse_tool_call_rejects_what_is_not_a_call():
    assert parse_tool_call('{"arguments": {}}') is None
    assert parse_tool_call('{"name": "f", "arguments": [1]}') is None
    assert parse_tool_call("<function=f>") is None
    assert parse_tool_call('{"name": "f", "parameters": {"a": 1}}').arguments == {"a": 1}


LLAMA3 = ' {"name": "get_weather", "parameters": {"city": "Paris"}}'
MISTRAL = '[{"name": "ls", "arguments": {}}, {"name": "cat", "arguments": {"path": "a"}}]'


@pytest.mark.parametrize("sizes", [[1], [3], [1000]])
def test_bare_json_calls_of_llama3_and_mistral(sizes):
    assert _run(LLAMA3, sizes) == [("tool_call", "get_weather", {"city": "Paris"})]
    assert _run(MISTRAL, sizes) == [("tool_call", "ls", {}), ("tool_call", "cat", {"path": "a"})]
    assert _run("<think>hm</think>" + LLAMA3, sizes)[-1] == ("tool_call", "get_weather", {"city": "Paris"})


def test_json_that_is_not_a_call_is_text_and_text_first_is_never_held():
    assert _run('{"answer": 42}', [2]) == [("text", '{"answer": 42}')]
    assert _run('[1, 2]', [2]) == [("text", "[1, 2]")]
    assert _run(LLAMA3, [3], tools=False) == [("text", LLAMA3)]
    parser = OutputParser()
    first = parser.push("Sure: ")  # answer text came first: later JSON is text, streamed as it comes
    assert [p.text for p in first] == ["Sure: "] and [p.text for p in parser.push('{"name": "x"}')] == ['{"name": "x"}']


@pytest.mark.parametrize("sizes", [[1], [4], [1000]])
def test_mistral_and_llama_marked_calls(sizes):
    """Mistral's [TOOL_CALLS] before a JSON list (older tokenizers) or before NAME[ARGS]{...} per call (newer,
    some with [CALL_ID]); Llama 3.1's <|python_tag|> before a JSON call. Text before a marker stays text."""
    assert _run('[TOOL_CALLS][{"name": "ls", "arguments": {}}]', sizes) == [("tool_call", "ls", {})]
    assert _run('[TOOL_CALLS]read_file[ARGS]{"path": "a.py"}[TOOL_CALLS]ls[ARGS]{}', sizes) == [
        ("tool_call", "read_file", {"path": "a.py"}), ("tool_call", "ls", {})]
    assert _run('Checking.[TOOL_CALLS]grep[CALL_ID]abc123XYZ[ARGS]{"q": "x"}', sizes) == [
        ("text", "Checking."), ("tool_call", "grep", {"q": "x"})]
    assert _run('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', sizes) == [
        ("tool_call", "get_weather", {"city": "Paris"})]
    # not calls after all: everything stays visible, marker included
    assert _run("[TOOL_CALLS]oops[ARGS]{not json", sizes) == [("text", "[TOOL_CALLS]oops[ARGS]{not json")]
    assert _run("[TOOL_CALLS]x[ARGS]{}", sizes, tools=False) == [("text", "[TOOL_CALLS]x[ARGS]{}")]


def test_markers_survive_decoding_where_the_vocabulary_flags_them_special(tmp_path):
    """A vocabulary may mark [TOOL_CALLS] as a control token; decoding for the server (special tokens skipped)
    must keep it, or the calls after it would read as plain text."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    from freetoken.engine.tokenizer import Tokenizer

    backend = Backend(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    backend.add_special_tokens(["[TOOL_CALLS]", "</s>"])
    tok = Tokenizer._assemble(backend, bos_id=None, eos_id=3, extra_eos=set(), add_bos=False, templates={})
    ids = [backend.token_to_id("[TOOL_CALLS]"), 0, backend.token_to_id("</s>")]
    kept = tok.decode(ids, skip_special_tokens=True)  # (a word-level vocabulary joins tokens with spaces)
    assert kept.startswith("[TOOL_CALLS]") and "</s>" not in kept
    assert tok.decode(ids).endswith("</s>")


# As GLM-4.5's chat template writes calls: the name, then key/value pairs; strings bare, other values as JSON.
GLM = ("<think>look first</think>\nI'll check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
       "<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
       "<arg_key>zip</arg_key>\n<arg_value>100000</arg_value>\n</tool_call>\n<tool_call>now\n</tool_call>")
# DeepSeek-V3.1 (name, separator, JSON) and V3/R1 (function, separator, name, fenced JSON).
DEEPSEEK_V31 = ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}"
                "<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
DEEPSEEK_V3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
               "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


@pytest.mark.parametrize("sizes", [[1], [3, 7], [1000]])
def test_glm_calls(sizes):
    """Values read as JSON unless the tool's schema types them as strings (`zip` here)."""
    got = _run(GLM, sizes, text_params={"get_weather": frozenset({"city", "zip"})})
    assert got == [("reasoning", "look first"), ("text", "I'll check.\n"),
                   ("tool_call", "get_weather", {"city": "Beijing", "days": 3, "zip": "100000"}), ("text", "\n"),
                   ("tool_call", "now", {})]
    assert _run("<tool_call>not a call at all</tool_call>", [4]) == [
        ("text", "<tool_call>not a call at all</tool_call>")]


@pytest.mark.parametrize("sizes", [[1], [5], [1000]])
def test_deepseek_calls(sizes):
    assert _run(DEEPSEEK_V31, sizes) == [("text", "Checking."), ("tool_call", "get_weather", {"city": "Paris"}),
                                         ("tool_call", "now", {})]
    assert _run(DEEPSEEK_V3, sizes) == [("tool_call", "get_weather", {"city": "Paris"})]
    broken = DEEPSEEK_V31.replace("{}", "{")
    assert _run(broken, sizes) == [("text", broken)]  # a call that does not parse stays visible


# DeepSeek-V4's DSML calls as its encoding writes them (reasoning first in thinking mode; strings as written,
# other values as JSON), and V3.2's spelling of the block.
DSML_V4 = ('<think>The user wants the weather.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
           '<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>\n'
           '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
           '<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="query" string="true">rain, "umbrella"\n'
           'or not</｜DSML｜parameter>\n<｜DSML｜parameter name="filters" string="false">{"site": ["a.com"], '
           '"fresh": true}</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
DSML_CALLS = [("tool_call", "get_weather", {"location": "Beijing", "days": 3}),
              ("tool_call", "search", {"query": 'rain, "umbrella"\nor not', "filters": {"site": ["a.com"],
                                                                                     "fresh": True}})]


@pytest.mark.parametrize("sizes", [[1], [4, 9], [1000]])
def test_dsml_calls(sizes):
    """V4's block, V3.2's, ASCII bars, a reply cut at the block's close (the end of the turn), a call without
    arguments; one whose JSON value does not parse stays visible as text."""
    assert _run(DSML_V4, sizes) == [("reasoning", "The user wants the weather."), *DSML_CALLS]
    v32 = DSML_V4.replace("tool_calls>", "function_calls>")
    assert _run(v32, sizes)[1:] == DSML_CALLS
    assert _run(DSML_V4.replace("｜DSML｜", "|DSML|"), sizes)[1:] == DSML_CALLS
    assert _run(DSML_V4.removesuffix("</｜DSML｜tool_calls>"), sizes)[1:] == DSML_CALLS
    bare = '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="now">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    assert _run(bare, sizes) == [("tool_call", "now", {})]
    broken = DSML_V4.replace('string="false">3<', 'string="false">three<')
    assert _run(broken, sizes)[1] == ("text", broken[broken.index("<｜DSML｜"):])


def test_dsml_templates_get_their_syntax_and_forced_openers():
    from freetoken.server.tool_choice import ToolChoice, call_opener, call_syntax

    v4 = 'You can invoke tools by writing a "<｜DSML｜tool_calls>" block{{ tools }}'
    v32 = 'You can invoke functions by writing a "<｜DSML｜function_calls>" block{{ tools }}'
    assert (call_syntax(v4), call_syntax(v32)) == ("dsml", "dsml-function-calls")
    text = DSML_V4[DSML_V4.index("<｜DSML｜"):]
    for template, reply in ((v4, text), (v32, text.replace("tool_calls>", "function_calls>"))):
        for choice in (ToolChoice("named", "get_weather"), ToolChoice("required")):
            opener = call_opener(choice, call_syntax(template))
            assert reply.startswith(opener), (opener, reply)
            assert _run(reply[len(opener):], [3], prefix=opener) == DSML_CALLS


def test_glm_and_deepseek_templates_get_their_syntax_and_forced_openers():
    from freetoken.server.tool_choice import ToolChoice, call_opener, call_syntax

    glm = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>{name}<arg_key>{k}</arg_key>"
    v31 = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + args}}"
    v3 = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>' + name + '\\n```json\\n'}}"
    assert (call_syntax(glm), call_syntax(v31), call_syntax(v3)) == ("glm", "deepseek", "deepseek-fenced")
    named = ToolChoice("named", "get_weather")
    for template, text in ((glm, GLM[GLM.index("<tool_call>"):]), (v31, DEEPSEEK_V31[len("Checking."):]),
                           (v3, DEEPSEEK_V3)):
        opener = call_opener(named, call_syntax(template))
        assert text.startswith(opener), (opener, text)
        rest = _run(text[len(opener):], [3], prefix=opener)
        assert rest[0][:2] == ("tool_call", "get_weather")


def _streamed(text: str, sizes: list[int], **kw) -> list:
    parser, parts, at, i = OutputParser(stream_calls=True, **kw), [], 0, 0
    while at < len(text):
        n = sizes[i % len(sizes)]
        parts += parser.push(text[at:at + n])
        at, i = at + n, i + 1
    return parts + parser.finish()


@pytest.mark.parametrize("sizes", [[1], [2], [3, 7], [1000]])
def test_a_hermes_call_streams_its_name_then_its_arguments_as_they_form(sizes):
    """With stream_calls, a call's name comes first (call_start), then its arguments' text as the model writes it
    (call_delta, braces and quotes inside strings followed), up to the end of the arguments object; the whole call
    closes it. Text around it is untouched."""
    arguments = '{"path": "a\\"}.py", "ranges": [[1, 2], {"to": 9}]}'
    text = f'Let me look.<tool_call>\n{{"name": "read_file", "arguments": {arguments}}}\n</tool_call> done'
    parts = _streamed(text, sizes)
    kinds = [p.kind for p in parts if p.kind != "text"]
    assert kinds[0] == "call_start" and kinds[-1] == "tool_call" and set(kinds[1:-1]) == {"call_delta"}
    assert parts[[p.kind for p in parts].index("call_start")].call.name == "read_file"
    streamed = "".join(p.text for p in parts if p.kind == "call_delta")
    final = next(p for p in parts if p.kind == "tool_call")
    assert streamed == arguments == final.text and final.streamed
    assert final.call.arguments == {"path": 'a"}.py', "ranges": [[1, 2], {"to": 9}]}
    assert "".join(p.text for p in parts if p.kind == "text") == "Let me look. done"
    if sizes == [1]:
        assert len(kinds) > 10  # one delta per character: the input shows as it is typed


def test_calls_that_cannot_stream_come_whole_and_one_cut_off_is_closed():
    """Arguments given as a string, a head that is not Hermes's and GLM's tagged calls are judged whole at the
    end, as without streaming; a call the reply ended inside is closed with what streamed."""
    for text in ['<tool_call>{"name": "ls", "arguments": "{}"}</tool_call>',
                 '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
                 "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"]:
        parts = _streamed(text, [2])
        assert [p.kind for p in parts] == ["tool_call"] and not parts[0].streamed, text
    cut = _streamed('<tool_call>{"name": "f", "arguments": {"a": [1, 2', [3])
    assert [p.kind for p in cut][0] == "call_start" and cut[-1].kind == "tool_call" and cut[-1].streamed
    assert cut[-1].text == '{"a": [1, 2' and cut[-1].call.name == "f"


@pytest.mark.parametrize("sizes", [[1], [2], [5, 3], [1000]])
def test_a_qwen3_coder_call_streams_its_parameters_as_json(sizes):
    """A Qwen3-Coder call becomes a JSON object as its parameters arrive: a parameter the schema types as a string
    streams its value as it forms (quotes, newlines and backslashes escaped, the format's own newlines dropped),
    any other value comes at its closing tag; joined, the deltas are the arguments the whole call parses to."""
    content = 'line "one"\n\\ two </param not a tag\n'
    text = (f"<tool_call>\n<function=write>\n<parameter=path>\nsrc/x.py\n</parameter>\n<parameter=content>\n"
            f"{content}\n</parameter>\n<parameter=mode>\n{{\"append\": true}}\n</parameter>\n"
            f"<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>")
    texts = {"write": frozenset({"path", "content", "count"})}
    parts = _streamed(text, sizes, text_params=texts)
    assert parts[0].kind == "call_start" and parts[0].call.name == "write" and parts[-1].kind == "tool_call"
    deltas = [p.text for p in parts if p.kind == "call_delta"]
    expected = {"path": "src/x.py", "content": content, "mode": {"append": True}, "count": "3"}
    assert json.loads("".join(deltas)) == expected == parts[-1].call.arguments
    assert parts[-1].streamed and parts[-1].text == "".join(deltas)
    if sizes == [1]:  # the text values streamed character by character, not at their ends
        assert len(deltas) > len(content)
    bare = _streamed("<tool_call>\n<function=ls>\n</function>\n</tool_call>", sizes)
    assert "".join(p.text for p in bare if p.kind == "call_delta") == "{}" and bare[-1].call.arguments == {}
