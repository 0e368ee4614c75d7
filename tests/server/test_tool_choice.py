"""tool_choice in the three protocols: parsed and checked, honoured by opening the reply as a call in the model's
own syntax (the parser reads the opening too), and tools described for templates that never render them."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from freetoken.server.errors import APIError
from freetoken.server.output import OutputParser
from freetoken.server.tool_choice import (
    ToolChoice,
    anthropic_choice,
    call_opener,
    call_syntax,
    openai_choice,
    with_tools_described,
)

NAMES = ["get_weather", "read_file"]

# the parts of real chat templates that decide the syntax (abridged)
TEMPLATES = {
    "hermes": "{%- if tools %}<tools>{{ tool | tojson }}</tools> ... <tool_call>\n{\"name\": ...}\n</tool_call>",
    "qwen-xml": "{%- if tools %}<tools>...</tools><tool_call>\n<function=example_function_name>\n<parameter=x>",
    "mistral-args": "{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                    "[TOOL_CALLS]{{ call.name }}[ARGS]{{ call.arguments|tojson }}",
    "mistral-json": "{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                    "[TOOL_CALLS][{{ tool_calls|tojson }}]",
    "llama3": "{%- if tools is not none %}Environment: ipython ... {\"name\": function name, \"parameters\": "
              "dictionary of argument name and its value} <|python_tag|>",
    "none": "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>"
            "{% endfor %}",
}

# what a model trained on each syntax writes after the opening of a call named get_weather
CONTINUATIONS = {
    "hermes": '{"city": "Paris"}}\n</tool_call>',
    "qwen-xml": "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "mistral-args": '{"city": "Paris"}',
    "mistral-json": '{"city": "Paris"}}]',
    "llama3": '{"city": "Paris"}}',
    "none": '{"city": "Paris"}}\n</tool_call>',  # taught the Hermes format by the system message
}


@pytest.mark.parametrize("syntax", list(TEMPLATES))
def test_the_syntax_is_read_from_the_template_and_a_named_opening_parses_as_that_call(syntax):
    assert call_syntax(TEMPLATES[syntax]) == syntax
    for in_reasoning in (False, True):
        opener = call_opener(ToolChoice("named", "get_weather"), syntax, in_reasoning)
        parser = OutputParser(in_reasoning=in_reasoning, prefix=opener)
        parts = parser.push(CONTINUATIONS[syntax]) + parser.finish()
        calls = [(p.call.name, p.call.arguments) for p in parts if p.kind == "tool_call"]
        assert calls == [("get_weather", {"city": "Paris"})], (syntax, opener, parts)
        assert not [p for p in parts if p.kind == "text" and p.text.strip()]


def test_required_opens_a_call_without_a_name_and_auto_opens_nothing():
    assert call_opener(ToolChoice("required"), "hermes") == "<tool_call>\n"
    assert call_opener(ToolChoice("required"), "mistral-args") == "[TOOL_CALLS]"
    assert call_opener(ToolChoice("required"), "qwen-xml", in_reasoning=True) == "</think>\n\n<tool_call>\n<function="
    assert call_opener(ToolChoice("auto"), "hermes") == call_opener(ToolChoice("none"), "hermes") == ""
    parser = OutputParser(prefix=call_opener(ToolChoice("required"), "hermes"))
    parts = parser.push('{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>') + parser.finish()
    assert [(p.call.name, p.call.arguments) for p in parts] == [("read_file", {"path": "a.py"})]


@pytest.mark.parametrize("value, expected", [
    (None, ToolChoice()), ("auto", ToolChoice()), ("none", ToolChoice("none")), ("required", ToolChoice("required")),
    ({"type": "function", "function": {"name": "read_file"}}, ToolChoice("named", "read_file")),
])
def test_openai_choices(value, expected):
    assert openai_choice(value, NAMES) == expected


@pytest.mark.parametrize("value, expected", [
    (None, ToolChoice()), ({"type": "auto"}, ToolChoice()), ({"type": "any"}, ToolChoice("required")),
    ({"type": "none"}, ToolChoice("none")),
    ({"type": "tool", "name": "get_weather"}, ToolChoice("named", "get_weather")),
])
def test_anthropic_choices(value, expected):
    assert anthropic_choice(value, NAMES) == expected


def test_parallel_calls_turned_off_in_either_protocol():
    """OpenAI's `parallel_tool_calls: false` (any choice; unset allows them) and Anthropic's
    `disable_parallel_tool_use`; the prompt then asks the sampler for one call (ChatPrompt.single_call)."""
    assert not openai_choice("auto", NAMES, parallel=False).parallel
    assert openai_choice("required", NAMES, parallel=None).parallel and openai_choice(None, NAMES).parallel
    named = openai_choice({"type": "function", "function": {"name": "read_file"}}, NAMES, parallel=False)
    assert named == ToolChoice("named", "read_file", parallel=False)
    assert anthropic_choice({"type": "any", "disable_parallel_tool_use": True}, NAMES) == \
        ToolChoice("required", parallel=False)
    assert anthropic_choice({"type": "auto", "disable_parallel_tool_use": False}, NAMES).parallel


def test_bad_choices_are_400s_that_say_what_is_wrong():
    cases = [
        (lambda: openai_choice({"type": "function", "function": {"name": "rm"}}, NAMES), "not among the tools"),
        (lambda: openai_choice("sometimes", NAMES), "tool_choice must be"),
        (lambda: openai_choice("required", []), "needs tools"),
        (lambda: openai_choice({"type": "function", "function": {"name": "x"}}, NAMES, responses=True),
         '{"type": "function", "name": ...}'),
        (lambda: anthropic_choice({"type": "tool"}, NAMES), "'type': 'tool', 'name'"),
        (lambda: anthropic_choice({"type": "any"}, []), "needs tools"),
    ]
    for make, fragment in cases:
        with pytest.raises(APIError) as e:
            make()
        assert e.value.status == 400 and fragment in e.value.message


def test_tools_are_described_in_the_system_message_when_the_template_ignores_them():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    described = with_tools_described([{"role": "user", "content": "hi"}], tools)
    assert described[0]["role"] == "system" and '"name": "get_weather"' in described[0]["content"]
    kept = with_tools_described([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], tools)
    assert kept[0]["content"].startswith("Be brief.\n\n") and "<tool_call>" in kept[0]["content"] and len(kept) == 2


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": CITY}}


def test_through_the_server_a_forced_call_lengthens_the_prompt_by_its_opening(smollm2_server):
    """SmolLM2's template never renders tools: they go into the system message, and a named choice ends the
    prompt with the opening of that call. (Whether a 135M model then writes good arguments is its business.)"""
    oai = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    ask = {"model": "smollm2", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 8,
           "temperature": 0}
    plain = oai.chat.completions.create(**ask).usage.prompt_tokens
    offered = oai.chat.completions.create(**ask, tools=[WEATHER]).usage.prompt_tokens
    named = oai.chat.completions.create(**ask, tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}).usage.prompt_tokens
    assert plain < offered < named
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        oai.chat.completions.create(**ask, tools=[WEATHER], tool_choice={"type": "function",
                                                                         "function": {"name": "rm"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        oai.responses.create(model="smollm2", input="hi", tool_choice="required", max_output_tokens=8)
    ant = anthropic.Anthropic(base_url=smollm2_server.url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    counted = ant.messages.count_tokens(model="smollm2", messages=msgs, tools=tools).input_tokens
    reply = ant.messages.create(model="smollm2", max_tokens=8, messages=msgs, tools=tools,
                                tool_choice={"type": "tool", "name": "get_weather"})
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens > counted  # the opening of the call
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        ant.messages.create(model="smollm2", max_tokens=8, messages=msgs, tools=tools,
                            tool_choice={"type": "tool", "name": "rm"})


@pytest.mark.parametrize("value", [{"type": "function", "function": "get_weather"}, {"type": "function"},
                                   {"type": "function", "function": {"name": 3}}, 7, ["required"]])
def test_malformed_openai_choices_are_400s(value):
    with pytest.raises(APIError) as e:
        openai_choice(value, NAMES)
    assert e.value.status == 400
    with pytest.raises(APIError):
        anthropic_choice(value, NAMES)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_of_a_small_model_comes_back_as_a_call_with_json_arguments(smollm2_server, tool_choice):
    """Hermes-format calls are constrained token by token: the call's body must be one JSON object and then
    `</tool_call>`, so even a 135M model's forced call parses into `tool_calls` with JSON arguments."""
    oai = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    reply = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                        tools=[WEATHER], tool_choice=tool_choice, temperature=0, max_tokens=96)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    call = choice.message.tool_calls[0]
    assert call.function.name and isinstance(json.loads(call.function.arguments), dict)


def test_a_forced_calls_arguments_satisfy_the_tools_parameters_schema(smollm2_server):
    """With required, typed, closed parameters the 135M model's arguments are exactly what the schema allows."""
    strict = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {**CITY, "required": ["city"],
                                                              "additionalProperties": False}}}
    oai = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    reply = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                        tools=[strict], tool_choice="required", temperature=0, max_tokens=96)
    call = reply.choices[0].message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) == {"city"} and isinstance(arguments["city"], str)


FULL_CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "qwen-xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "glm": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "deepseek": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}"
                "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "deepseek-fenced": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                       "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "mistral-json": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "mistral-args": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "dsml": '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">'
            'Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
    "dsml-function-calls": '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter '
                           'name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
                           '</｜DSML｜function_calls>',
}


@pytest.mark.parametrize("syntax", list(FULL_CALLS))
@pytest.mark.parametrize("choice", [ToolChoice("auto"), ToolChoice("required"), ToolChoice("named", "get_weather")])
def test_the_reply_is_constrained_to_calls_in_the_models_format(syntax, choice):
    """ChatPrompt.constrain hands the sampler the call format, the offered tools and, for a forced call, the
    opening the prompt wrote; the language built from them accepts that opening and a well-formed call."""
    from freetoken.engine.call_languages import CALL_MARKERS
    from freetoken.engine.json_sampler import language_for
    from freetoken.engine.sampling import SamplingParams
    from freetoken.server.engine import ChatPrompt, constrained_format, offered_schemas, offered_tools

    fmt = constrained_format(syntax)
    opener = call_opener(choice, syntax)
    chat = ChatPrompt("…" + opener, [], opener, False, True, call_format=fmt, call_tools=offered_tools([WEATHER]),
                      call_schemas=offered_schemas([WEATHER]))
    params = chat.constrain(SamplingParams())
    assert params.call_format == fmt == syntax and chat.constrain(SamplingParams(json_object=True)).call_format == ""
    assert params.call_tools == (("get_weather", ("city",)),)
    language = language_for(params)
    assert language.can_end == (not choice.forces_call)
    marker = CALL_MARKERS[fmt]
    written = params.call_opening or ""
    assert (marker + written).endswith(opener.split("</think>")[-1].lstrip()) if choice.forces_call else not written
    full = FULL_CALLS[fmt]
    rest = full[len(marker) + len(written):] if choice.forces_call else full
    assert language.copy().feed(rest) and language.copy().feed(rest + " ")
    assert language.feed(rest) and language.can_end
    if fmt not in ("qwen-xml", "glm", "dsml", "dsml-function-calls"):  # JSON arguments: city must be a string
        wrong = full.replace('"Paris"', "7")
        assert not language_for(params).feed(wrong[len(marker) + len(written):] if choice.forces_call else wrong)


def test_a_forced_call_streams_its_arguments_in_every_protocol(smollm2_server):
    """Streamed, a call goes out as it forms: its name first, then its arguments in several deltas, which put
    together are the call's JSON arguments (OpenAI `tool_calls` chunks, Anthropic `input_json_delta` events in a
    `tool_use` block, Responses `function_call_arguments.delta` events)."""
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    strict = {**CITY, "required": ["city"], "additionalProperties": False}  # a short call, well inside max_tokens
    oai = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    chunks = [c for c in oai.chat.completions.create(
        model="smollm2", messages=msgs, tool_choice="required", tools=[
            {"type": "function", "function": {"name": "get_weather", "parameters": strict}}], temperature=0,
        max_tokens=96, stream=True) if c.choices]
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
    pieces = [d.function.arguments for d in calls[1:]]
    assert len(pieces) >= 2 and all(d.index == 0 and d.id is None for d in calls[1:])
    assert isinstance(json.loads("".join(pieces)), dict) and chunks[-1].choices[0].finish_reason == "tool_calls"

    ant = anthropic.Anthropic(base_url=smollm2_server.url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "input_schema": strict}]
    with ant.messages.stream(model="smollm2", max_tokens=96, messages=msgs, tools=tools,
                             tool_choice={"type": "tool", "name": "get_weather"},
                             extra_body={"temperature": 0}) as stream:
        events = list(stream)
        message = stream.get_final_message()
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"
               and e.delta.type == "input_json_delta"]
    block = next(b for b in message.content if b.type == "tool_use")
    assert len(partial) >= 2 and block.name == "get_weather" and block.input == json.loads("".join(partial))
    assert message.stop_reason == "tool_use"

    stream = oai.responses.create(model="smollm2", input="Weather in Paris?", tools=[
        {"type": "function", "name": "get_weather", "parameters": strict}], tool_choice="required",
        max_output_tokens=96, temperature=0, stream=True)
    events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) >= 2 and "".join(deltas) == done.arguments and isinstance(json.loads(done.arguments), dict)
    item = next(o for o in events[-1].response.output if o.type == "function_call")
    assert item.name == "get_weather" and item.arguments == done.arguments


def test_codex_style_responses_without_parallel_calls_get_one_call(smollm2_server):
    """Codex asks the Responses API for `parallel_tool_calls: false`: the reply holds one function call and
    nothing after it (the sampler ends the reply there) and the response echoes the setting."""
    oai = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    reply = oai.responses.create(model="smollm2", input="Weather in Paris, then in Rome?", tools=[
        {"type": "function", "name": "get_weather", "parameters": {**CITY, "required": ["city"],
                                                                    "additionalProperties": False}}],
        tool_choice="required", parallel_tool_calls=False, max_output_tokens=96, temperature=0)
    assert [o.type for o in reply.output] == ["function_call"]  # (with parallel calls on, text follows here)
    assert reply.parallel_tool_calls is False


def test_tool_choice_none_keeps_the_tools_in_the_prompt_and_answers_in_text(smollm2_server):
    """The tools stay rendered under `none` (the prompt is auto's, so the turn reuses a history rendered with
    them), and whatever the model writes comes back as text, never as a call."""
    oai = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    ask = {"model": "smollm2", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
           "temperature": 0, "max_tokens": 24}
    auto = oai.chat.completions.create(**ask, tool_choice="auto")
    none = oai.chat.completions.create(**ask, tool_choice="none")
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens
    assert none.usage.prompt_tokens_details.cached_tokens > 0  # auto's prompt, cached
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason in ("stop", "length")
    bare = oai.chat.completions.create(**{**ask, "tools": None})
    assert bare.usage.prompt_tokens < none.usage.prompt_tokens  # the tools' description is in the prompt
