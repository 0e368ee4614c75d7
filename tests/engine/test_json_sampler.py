"""Constrained sampling on a toy vocabulary: the sampler draws what the logits prefer unless its text leaves the
language, and then takes the best token that stays in it."""

from __future__ import annotations

import json

import pytest
import torch

from freetoken.engine.call_languages import HermesCalls, Llama3Calls, MistralCalls
from freetoken.engine.json_sampler import ConstrainedSampler, JsonObject
from freetoken.engine.sampling import Sampler, SamplingParams
from freetoken.engine.tag_calls import QwenXmlCalls

VOCAB = ["<eos>", "<tool_call>", "</tool_call>", "{", "}", '"a"', ":", "1", " ", "hello", "x", "\n", "</", "tool_call>",
         ", ", '"b"']
EOS = frozenset({0})
GREEDY = SamplingParams(temperature=0)


def _vocab_bytes(token: int) -> bytes:
    return VOCAB[token].encode()


def _run(language, preferences: list[list[str]], params: SamplingParams = GREEDY) -> str:
    """Each step's logits rank `preferences[step]` first (in order), every other token far below."""
    sampler = ConstrainedSampler(Sampler(params, torch.device("cpu")), _vocab_bytes, EOS, language)
    out = []
    for ranked in preferences:
        logits = torch.full((len(VOCAB),), -10.0)
        for rank, text in enumerate(ranked):
            logits[VOCAB.index(text)] = 10.0 - rank
        token = sampler(logits)
        if token in EOS:
            break
        out.append(VOCAB[token])
    return "".join(out)


def test_a_json_object_reply_refuses_what_breaks_it_and_ends_when_closed():
    steps = [["x", "{"], ['"a"'], ["}", ":"], ["x", "1"], ["1", "}"], ["hello", "}"], ["hello", " "]]
    text = _run(JsonObject(), steps)
    assert json.loads(text) == {"a": 11}


def test_free_text_is_untouched_but_a_call_body_must_be_json_then_closed():
    steps = [["hello"], [" "], ["<tool_call>"], ["x", "\n"], ["hello", "{"], ['"a"'], [":"], ["1"],
             ["x", "}"], ["hello", "\n"], ["x", "</tool_call>"], ["hello"], ["<eos>"]]
    text = _run(HermesCalls(), steps)
    assert text == 'hello <tool_call>\n{"a":1}\n</tool_call>hello'


def test_the_closing_marker_may_come_in_pieces_and_eos_waits_for_it():
    steps = [["{"], ["}"], ["<eos>", "</"], ["<eos>", "tool_call>"], ["<eos>"]]
    assert _run(HermesCalls(opened="\n"), steps) == "{}</tool_call>"


def test_a_call_must_name_an_offered_tool():
    vocab_calls = HermesCalls(names=("f", "g"))
    assert vocab_calls.feed('<tool_call>\n{"name": "')
    assert not vocab_calls.copy().feed('h"') and vocab_calls.copy().feed('g", "arguments": {}}</tool_call>')
    assert HermesCalls(opened='\n{"name": "f", "arguments": ', names=("f",)).feed('{"x": 1}}\n</tool_call>')
    with pytest.raises(ValueError):
        HermesCalls(opened='\n{"name": "h", "arguments": ', names=("f",))


def test_a_tools_arguments_must_satisfy_its_parameters_schema():
    """With the tool's parameters schema: required arguments, their types and no unknown ones; a tool without a
    schema keeps free JSON arguments; the call object itself holds only name and arguments."""
    schema = json.dumps({"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
                         "required": ["path"], "additionalProperties": False})
    calls = HermesCalls(names=("read", "free"), schemas=(("read", schema),))
    assert calls.feed('<tool_call>\n{"name": "read", "arguments": {')
    assert not calls.copy().feed("}")  # path is required
    assert not calls.copy().feed('"size"')  # not a parameter of read
    assert not calls.copy().feed('"path": 3')  # a string is due
    assert not calls.copy().feed('"path": "a", "lines": 1.5')  # an integer is due
    assert not calls.copy().feed('"path": "a"}, "extra"')  # the call object has nothing else
    assert calls.copy().feed('"path": "a.py", "lines": 20}}\n</tool_call>')
    free = HermesCalls(names=("read", "free"), schemas=(("read", schema),))
    assert free.feed('<tool_call>{"name": "free", "arguments": {"anything": [1, 2]}}</tool_call>')
    forced = HermesCalls(opened='\n{"name": "read", "arguments": ', names=("read",), schemas=(("read", schema),))
    assert not forced.copy().feed("{}") and forced.feed('{"path": "x"}}</tool_call>')


def test_a_forced_call_starts_inside_its_opening():
    opening = '\n{"name": "f", "arguments": '
    steps = [["hello", "{"], ['"b"'], [":"], ["1"], ["}"], ["x", "}"], ["</tool_call>"], ["<eos>"]]
    text = _run(HermesCalls(opened=opening), steps)
    assert json.loads(opening + text.removesuffix("</tool_call>")) == {"name": "f", "arguments": {"b": 1}}
    with pytest.raises(ValueError):
        HermesCalls(opened="not json")


def test_sampling_stays_in_the_language():
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, seed=3)
    sampler = ConstrainedSampler(Sampler(params, torch.device("cpu")), _vocab_bytes, EOS, JsonObject())
    out = []
    for _ in range(40):
        token = sampler(torch.randn(len(VOCAB), generator=gen))
        if token in EOS:
            break
        out.append(VOCAB[token])
    text = "".join(out)
    if token in EOS:
        assert isinstance(json.loads(text), dict)
    else:  # ran out of steps: still a prefix of an object
        from freetoken.engine.json_prefix import JsonPrefix
        assert JsonPrefix().feed(text)


def test_qwen_xml_calls_name_an_offered_tool_and_its_parameters():
    tools = (("read_file", ("path", "limit")), ("run", ()))
    calls = QwenXmlCalls(tools=tools)
    assert calls.feed("Let me look.\n<tool_call>\n<function=")
    assert not calls.copy().feed("write_file>") and calls.copy().feed("run>")
    assert calls.feed("read_file>\n<parameter=")
    assert not calls.copy().feed("mode>") and not calls.copy().feed("</tool_call>")
    assert calls.feed("path>\nsrc/a.py\n</parameter>\n") and not calls.can_end
    assert calls.feed("</function>\n</tool_call>") and calls.can_end
    anything = QwenXmlCalls(tools=tools)  # a tool without declared parameters takes any names
    assert anything.feed("<tool_call><function=run><parameter=cmd>ls -la\n</parameter></function></tool_call>")
    assert not anything.copy().feed("<tool_call><function=run><parameter=>")
    forced = QwenXmlCalls(opened="\n<function=run>\n", tools=tools)
    assert forced.feed("</function>\n</tool_call>") and forced.can_end
    with pytest.raises(ValueError):
        QwenXmlCalls(opened="\n<function=rm>", tools=tools)


READ_SCHEMA = json.dumps({"type": "object", "required": ["path"], "properties": {
    "path": {"type": "string"}, "limit": {"type": "integer"}, "mode": {"enum": ["text", "bytes"]},
    "ranges": {"type": "array", "items": {"type": "integer"}}, "follow": {"type": "boolean"}}})
READ_TOOL = (("read_file", ("path", "limit", "mode", "ranges", "follow")),)


def _read_call() -> QwenXmlCalls:
    calls = QwenXmlCalls(tools=READ_TOOL, schemas=(("read_file", READ_SCHEMA),))
    assert calls.feed("<tool_call>\n<function=read_file>\n")
    return calls


def test_qwen_xml_values_are_typed_by_the_schema():
    calls = _read_call()
    assert calls.feed("<parameter=path>\n10 </not-a-close> \"x\"\n</parameter>\n")  # strings: free text
    assert not calls.copy().feed("<parameter=path>")  # each parameter once
    for bad in ("ten", "1.5", "1,", "[1]"):
        assert not calls.copy().feed(f"<parameter=limit>\n{bad}"), bad
    assert not calls.copy().feed("<parameter=limit>\n-<")  # a close after no whole value
    assert calls.copy().feed("<parameter=limit>\n-12\n</parameter>\n</function>")
    assert calls.copy().feed("<parameter=limit>40</parameter>")
    assert not calls.copy().feed("<parameter=mode>\ntexts") and not calls.copy().feed("<parameter=mode>\n\"text")
    assert not calls.copy().feed("<parameter=mode>\ntex<")
    assert calls.copy().feed("<parameter=mode>\nbytes\n</parameter>")
    assert not calls.copy().feed("<parameter=ranges>\n[1, \"a\"") and not calls.copy().feed("<parameter=ranges>{")
    assert calls.copy().feed("<parameter=ranges>\n[1, 2]\n</parameter>")
    assert not calls.copy().feed("<parameter=follow>yes") and calls.copy().feed("<parameter=follow>false</parameter>")
    assert not calls.copy().feed("<parameter=limit>1</parameter> x")  # after a value: parameters or the end


def test_qwen_xml_required_parameters_come_before_the_function_closes():
    calls = _read_call()
    assert not calls.copy().feed("</function>")
    assert calls.feed("<parameter=limit>3</parameter>\n") and not calls.copy().feed("</function>")
    assert calls.feed("<parameter=path>a.py</parameter>\n</function>\n</tool_call>") and calls.can_end


def test_qwen_xml_typed_values_parse_back_as_the_schema_types():
    """What the constraint lets through, the server's parser reads as the typed values."""
    from freetoken.server.output import parse_tool_call, text_parameters
    body = ("<function=read_file>\n<parameter=path>\n42\n</parameter>\n<parameter=limit>\n40\n</parameter>\n"
            "<parameter=ranges>\n[1, 2]\n</parameter>\n<parameter=follow>\ntrue\n</parameter>\n"
            "<parameter=mode>\nbytes\n</parameter>\n</function>\n")
    calls = QwenXmlCalls(tools=READ_TOOL, schemas=(("read_file", READ_SCHEMA),))
    assert calls.feed("<tool_call>\n" + body + "</tool_call>") and calls.can_end
    call = parse_tool_call(body, text_parameters((("read_file", READ_SCHEMA),)))
    assert call.arguments == {"path": "42", "limit": 40, "ranges": [1, 2], "follow": True, "mode": "bytes"}


def test_glm_calls_name_an_offered_tool_and_its_typed_arguments():
    from freetoken.engine.tag_calls import GlmCalls

    calls = GlmCalls(tools=READ_TOOL + (("now", ()),), schemas=(("read_file", READ_SCHEMA),))
    assert calls.feed("Reading.\n<tool_call>") and not calls.copy().feed("write_file")
    assert not calls.copy().feed("read_file\n</tool_call>")  # path is required
    assert calls.feed("read_file\n<arg_key>limit</arg_key>\n<arg_value>40</arg_value>\n")
    assert not calls.copy().feed("<arg_key>limit</arg_key>")  # each key once
    assert not calls.copy().feed("<arg_key>mode</arg_key><arg_value>texts")  # an enum's values only
    assert not calls.copy().feed("<arg_key>follow</arg_key><arg_value>yes")  # a boolean is JSON
    assert calls.feed("<arg_key>path</arg_key>\n<arg_value>src/a b.py</arg_value>\n</tool_call>") and calls.can_end
    assert calls.feed(" then <tool_call>now\n<arg_key>any</arg_key><arg_value>x</arg_value></tool_call>")
    forced = GlmCalls(opened="read_file\n", tools=READ_TOOL, schemas=(("read_file", READ_SCHEMA),))
    assert forced.feed("<arg_key>path</arg_key><arg_value>a</arg_value></tool_call>") and forced.can_end
    with pytest.raises(ValueError):
        GlmCalls(opened="rm\n", tools=READ_TOOL)


def test_dsml_calls_type_their_parameters_by_the_schema_then_the_reply_ends():
    """DeepSeek-V4: offered tools, each parameter once with the string flag its schema type asks for (strings and
    string enums "true", other types "false" and JSON under the schema), the required ones before the invoke
    closes, several invokes, then the block's close and nothing but the end; what it lets through the server's
    parser reads back as the typed values."""
    from freetoken.engine.dsml_calls import DsmlCalls
    from freetoken.server.output import parse_dsml_calls

    def p(name, kind, value):
        return f'<｜DSML｜parameter name="{name}" string="{kind}">{value}</｜DSML｜parameter>\n'

    calls = DsmlCalls(tools=READ_TOOL + (("now", ()),), schemas=(("read_file", READ_SCHEMA),))
    assert calls.feed("Reading.\n<｜DSML｜tool_calls>\n") and not calls.can_end
    assert not calls.copy().feed('<｜DSML｜invoke name="write_file">')
    assert calls.feed('<｜DSML｜invoke name="read_file">\n')
    assert not calls.copy().feed("</｜DSML｜invoke>")  # path is required
    assert not calls.copy().feed(p("path", "false", '"a"'))  # a string-typed value is written as one
    assert not calls.copy().feed(p("limit", "true", "40")) and not calls.copy().feed(p("limit", "false", "4x"))
    assert not calls.copy().feed(p("mode", "true", "texts")) and not calls.copy().feed(p("follow", "false", "yes"))
    body = p("limit", "false", "40") + p("ranges", "false", "[1, 2]") + p("mode", "true", "bytes") + \
        p("path", "true", 'src/a "b".py') + "</｜DSML｜invoke>\n"
    assert calls.feed(body) and not calls.copy().feed(p("limit", "false", "1"))
    assert calls.feed('<｜DSML｜invoke name="now">\n' + p("any", "false", '{"x": [1]}') + p("other", "true", "t"))
    assert calls.feed("</｜DSML｜invoke>\n</｜DSML｜tool_calls>") and calls.can_end and calls.must_end
    assert not calls.copy().feed(" more") and calls.copy().feed("\n")
    text = '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="read_file">\n' + body + "</｜DSML｜tool_calls>"
    assert parse_dsml_calls(text)[0].arguments == {"limit": 40, "ranges": [1, 2], "mode": "bytes",
                                                   "path": 'src/a "b".py'}
    forced = DsmlCalls(opened='\n<｜DSML｜invoke name="read_file">\n', tools=READ_TOOL,
                       schemas=(("read_file", READ_SCHEMA),), function_calls=True)
    assert forced.feed(p("path", "true", "a") + "</｜DSML｜invoke>\n</｜DSML｜function_calls>") and forced.can_end
    with pytest.raises(ValueError):
        DsmlCalls(opened='\n<｜DSML｜invoke name="rm">', tools=READ_TOOL)


def test_with_parallel_calls_off_the_first_call_ends_the_reply():
    """`call_single` (the request turned parallel calls off): in every format the reply must end once its first
    call is written (only whitespace may follow), where otherwise a second call or more text could."""
    from freetoken.engine.json_sampler import language_for
    from freetoken.engine.sampling import SamplingParams

    tools, weather = (("get_weather", ("city",)),), '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    b, e = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    dsml_call = ('<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Paris'
                 '</｜DSML｜parameter>\n</｜DSML｜invoke>\n')
    cases = {  # format: (one call, what a second call or more text would add)
        "hermes": (f"<tool_call>{weather}</tool_call>", f" and <tool_call>{weather}</tool_call>"),
        "qwen-xml": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                     "</tool_call>", " more"),
        "glm": ("<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
                "<tool_call>"),
        "mistral-json": (f"[TOOL_CALLS][{weather}", f", {weather}]"),
        "mistral-args": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "[TOOL_CALLS]"),
        "deepseek": (f'<｜tool▁calls▁begin｜>{b}get_weather<｜tool▁sep｜>{{"city": "Paris"}}{e}', b),
        "dsml": ("<｜DSML｜tool_calls>\n" + dsml_call, dsml_call),
    }
    for fmt, (one, more) in cases.items():
        for single in (False, True):
            language = language_for(SamplingParams(call_format=fmt, call_tools=tools, call_single=single))
            assert language.feed("Sure. " + one), fmt
            assert language.copy().feed(more) != single, (fmt, single)
    ends = {"mistral-json": "]", "deepseek": "<｜tool▁calls▁end｜>", "dsml": "</｜DSML｜tool_calls>"}
    for fmt, (one, _) in cases.items():
        language = language_for(SamplingParams(call_format=fmt, call_tools=tools, call_single=True))
        assert language.feed(one + ends.get(fmt, "")) and language.must_end and language.feed("\n"), fmt


def test_deepseek_calls_are_offered_tools_with_schema_arguments_then_the_end():
    from freetoken.engine.call_languages import DeepseekCalls

    b, e, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    calls = DeepseekCalls(names=("read_file", "now"), schemas=(("read_file", READ_SCHEMA),))
    assert calls.feed("Let me read it.<｜tool▁calls▁begin｜>" + b) and not calls.can_end
    assert not calls.copy().feed("rm" + sep) and not calls.copy().feed("read_file" + sep + '{"limit": 3}' + e)
    assert calls.feed("read_file" + sep + '{"path": "a.py"}' + e + "\n" + b + "now" + sep + "{}" + e)
    assert not calls.must_end and calls.feed("<｜tool▁calls▁end｜>") and calls.must_end
    assert not calls.copy().feed("more text")
    fenced = DeepseekCalls(opened=b + "function" + sep, names=("now",), fenced=True)
    assert fenced.feed("now\n```json\n{}\n```" + e + "<｜tool▁calls▁end｜>") and fenced.must_end


def test_harmony_calls_name_an_offered_tool_then_schema_arguments_then_the_end():
    """gpt-oss: the reply's messages are free; a header naming `to=functions.NAME` must name an offered tool, run
    on to `<|message|>` (either placement of the recipient), then the arguments under the schema, then the end."""
    from freetoken.engine.call_languages import HarmonyCalls

    calls = HarmonyCalls(names=("read_file", "now"), schemas=(("read_file", READ_SCHEMA),))
    assert calls.feed("<|channel|>analysis<|message|>Reading the file.<|end|><|start|>assistant") and calls.can_end
    assert calls.feed("<|channel|>commentary to=functions.") and not calls.can_end
    assert not calls.copy().feed("rm -rf") and not calls.copy().feed("read_file <|constrain|>json<|message|>[")
    assert not calls.copy().feed('read_file <|constrain|>json<|message|>{"limit": 3}')  # lacks the required path
    assert calls.feed('read_file <|constrain|>json<|message|>{"path": "a.py"}') and calls.must_end
    in_role = HarmonyCalls(names=("now",))
    assert in_role.feed("<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}")
    assert in_role.must_end
    forced = HarmonyCalls(opened="", names=("now",))  # the prompt wrote "<|channel|>commentary to=functions."
    assert not forced.can_end and forced.feed(" <|constrain|>json<|message|>{}") is False
    assert forced.feed("now <|constrain|>json<|message|>{}") and forced.must_end


def test_mistral_calls_json_lists_and_name_args_forms():
    schema = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    listed = MistralCalls(names=("get_weather", "f"), schemas=(("get_weather", schema),))
    assert listed.feed("Let me check. [TOOL_CALLS][")
    assert not listed.copy().feed('{"name": "rm"')  # not an offered tool
    assert not listed.copy().feed('{"name": "get_weather", "arguments": {}}')  # city is required
    assert listed.feed('{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}')
    assert not listed.can_end and listed.feed("]") and listed.can_end
    args = MistralCalls(names=("get_weather",), schemas=(("get_weather", schema),), args=True)
    assert args.feed("[TOOL_CALLS]") and not args.copy().feed("rm[ARGS]")
    assert not args.copy().feed('get_weather[ARGS]{"city": 1}')
    assert args.copy().feed('get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}')
    with_id = args.copy()
    assert with_id.feed('get_weather[CALL_ID]a1B2[ARGS]{"city": "Paris"}') and with_id.can_end
    assert not args.copy().feed("get_weather[CALL_ID]a-b")  # ids are letters and digits
    forced = MistralCalls(opened="get_weather[ARGS]", names=("get_weather",), args=True)
    assert not forced.can_end and forced.feed('{"x": 1}') and forced.can_end


def test_llama3_replies_are_free_text_or_one_json_call_then_the_end():
    schema = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                         "additionalProperties": False})
    words = Llama3Calls(names=("get_weather",), schemas=(("get_weather", schema),))
    assert words.feed("The weather is { whatever } I like.") and words.can_end
    call = Llama3Calls(names=("get_weather",), schemas=(("get_weather", schema),))
    assert not call.copy().feed('{"name": "get_time"')
    assert not call.copy().feed('{"name": "get_weather", "parameters": {"town": "x"}}')
    assert call.feed(' {"name": "get_weather", "parameters": {"city": "Paris"}}') and call.must_end
    assert call.copy().feed("\n") and not call.copy().feed(" more")
    tagged = Llama3Calls(names=("get_weather",))
    assert tagged.feed('<|python_tag|>{"name": "get_weather", "parameters": {"any": 1}}') and tagged.must_end
    assert Llama3Calls(names=("get_weather",)).feed("<|python is fun")  # not the tag: free text
